"""The multi-device scripts' output: each row printed as it comes and the rows so far
rewritten to a JSON file, so that a run cut short (a time limit) keeps what it measured."""

from __future__ import annotations

import json


class RowLog:
    def __init__(self, json_path: str | None):
        self.rows: list[dict] = []
        self.json_path = json_path

    def __call__(self, row: dict) -> None:
        self.rows.append(row)
        print("  ".join(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}"
                        for key, value in row.items()), flush=True)
        if self.json_path:
            with open(self.json_path, "w") as f:
                json.dump(self.rows, f, indent=1)
