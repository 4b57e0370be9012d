"""What a plan says, and what a caller may override in it.

* `BlockSizes`: the caller's overrides, every field None (the plan's choice) by
  default: tiles, warps and stages per kernel, a backend per kernel, and whether
  the dK/dV kernel writes the bias gradient. Validated here for what holds on every
  backend; the routing table (dispatch.py) checks them against the backend a role
  runs on, with an error naming the field.
* `Route`: one role's decision: backend, tiles, consumer warpgroups, and why each
  faster backend was not taken.
* `Plan`: the routes of one call, and the number of persistent programs.

Pure data, no imports from the rest of the package besides the device.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from pallas_attn.device import DeviceInfo

ROLES = ("forward", "dq", "dkdv", "dbias")
ROLE_LABELS = {"forward": "forward", "dq": "dQ", "dkdv": "dK/dV", "dbias": "dbias"}
KERNEL_BACKENDS = ("mosaic", "triton")
# The BlockSizes fields of each role: (block_q, block_k, warps, stages) and its backend.
TILE_FIELDS = {
    "forward": ("block_q", "block_k", "num_warps", "num_stages"),
    "dkdv": ("block_q_dkv", "block_k_dkv", "num_warps_dkv", "num_stages_dkv"),
    "dq": ("block_q_dq", "block_k_dq", "num_warps_dq", "num_stages_dq"),
    "dbias": ("block_q_dbias", "block_k_dbias", "num_warps_dbias", "num_stages_dbias"),
}
BACKEND_FIELDS = {"forward": "forward_backend", "dkdv": "dkv_backend", "dq": "dq_backend",
                  "dbias": "dbias_backend"}


def _is_tile(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 16 and x & (x - 1) == 0


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Overrides of the tiles and backends the routing table chooses (None: its choice).

    Tiles (block_q, block_k per kernel) are powers of two of at least 16 (Triton
    needs power-of-two blocks; 16 is the smallest tensor-core operand); they are
    clamped to the (power-of-two rounded) sequence lengths. Results never depend on
    them. The dbias fields matter only when a bias is differentiated.

    forward_backend / dkv_backend / dq_backend / dbias_backend: "triton" (every GPU
    from sm80, every feature) or "mosaic" (sm90's warp-specialised kernels, for the
    problems `pallas_attn.explain` shows them covering); forward_backend also "decode"
    (the split-key kernel for a few query rows: block_k, num_warps, num_stages apply).
    A Mosaic kernel runs fixed tiles (forward: block_q 128, block_k 64 or 128,
    num_stages >= 2; dK/dV: 64 x 128; dQ: 128 x 64, num_stages_dq >= 2; dbias: 128 x 64
    or 128); warps do not apply.

    fuse_dbias: True: the dK/dV kernel writes dbias from the dS tiles it computes
    anyway (Triton: a bias with its own entry per batch entry, head and key; Mosaic:
    also one shared by the batch entries); False: a separate dbias kernel.

    deterministic: True (the default): every gradient is bitwise the same from run to
    run. False: the Mosaic dK/dV kernel may sum the fused gradient of a bias shared by
    the batch entries with concurrent programs' reduce-add copies, in no fixed order
    (faster; its roundings then vary from run to run).
    """

    block_q: int | None = None
    block_k: int | None = None
    block_q_dkv: int | None = None
    block_k_dkv: int | None = None
    block_q_dq: int | None = None
    block_k_dq: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    num_warps_dkv: int | None = None
    num_stages_dkv: int | None = None
    num_warps_dq: int | None = None
    num_stages_dq: int | None = None
    block_q_dbias: int | None = None
    block_k_dbias: int | None = None
    num_warps_dbias: int | None = None
    num_stages_dbias: int | None = None
    fuse_dbias: bool | None = None
    deterministic: bool = True
    forward_backend: str | None = None
    dbias_backend: str | None = None
    dkv_backend: str | None = None
    dq_backend: str | None = None

    def __post_init__(self):
        for field in dataclasses.fields(self):  # NumPy integers (e.g. from a sweep) as ints
            value = getattr(self, field.name)
            if isinstance(value, np.integer):
                object.__setattr__(self, field.name, int(value))
        for role, (bq, bk, warps, stages) in TILE_FIELDS.items():
            for field in (bq, bk):
                value = getattr(self, field)
                if value is not None and not _is_tile(value):
                    raise ValueError(
                        f"BlockSizes.{field} must be a power of two >= 16, got {value!r}")
            value = getattr(self, warps)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value not in (1, 2, 4, 8, 16)):
                raise ValueError(f"BlockSizes.{warps} must be 1, 2, 4, 8 or 16, got {value!r}")
            value = getattr(self, stages)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or not 1 <= value <= 8):
                raise ValueError(f"BlockSizes.{stages} must be an int in [1, 8], got {value!r}")
            field = BACKEND_FIELDS[role]
            allowed = (*KERNEL_BACKENDS, "decode") if field == "forward_backend" else (
                KERNEL_BACKENDS)
            if getattr(self, field) not in (None, *allowed):
                raise ValueError(f"BlockSizes.{field} must be None or one of "
                                 f"{allowed}, got {getattr(self, field)!r}")
        if self.fuse_dbias is not None and not isinstance(self.fuse_dbias, bool):
            raise ValueError(
                f"BlockSizes.fuse_dbias must be True, False or None, got {self.fuse_dbias!r}")
        if not isinstance(self.deterministic, bool):
            raise ValueError(
                f"BlockSizes.deterministic must be True or False, got {self.deterministic!r}")

    def tiles(self, role: str) -> tuple[int | None, int | None, int | None, int | None]:
        """(block_q, block_k, warps, stages) overrides of one role (None: not given)."""
        return tuple(getattr(self, f) for f in TILE_FIELDS[role])

    def backend(self, role: str) -> str | None:
        return getattr(self, BACKEND_FIELDS[role])


@dataclasses.dataclass(frozen=True)
class Route:
    """Which backend runs one role, with which tiles, and why not a faster one.

    backend: "mosaic", "triton", "decode" (the forward only: Triton's split-key kernel
    for a few query rows, kernels/triton/decode.py) or "xla". Tiles: block_q x block_k,
    num_warps (Triton) and num_stages (Triton's pipelining depth, a Mosaic kernel's ring
    slots). consumers: a Mosaic kernel's consumer warpgroups (0 for Triton). splits: the
    decode kernel's programs per kv head along the keys. fused: dbias only, written by
    the dK/dV kernel (its backend and tiles then). in_dq: dbias only, of a bias broadcast
    along keys, summed from the Mosaic dQ kernel's row sums (its tiles then). any_order:
    a fused dbias only, of a bias shared by the batch entries, summed by concurrent
    programs in no fixed order
    (else each program adds an item's batch entries in turn). keys_major: the Mosaic dK/dV kernel
    computes its tiles keys by queries (S^T = K Q^T). early_q: the Mosaic forward's
    consumers load their next item's Q right after its last Q K^T, not after its output.
    early_release: the Mosaic dK/dV kernel gives each unit's K and V back after its last
    S and dP, not after its last step. declined: (backend, reason) for
    each backend preferred over this one that does not run it. repair: the Triton
    kernel that recomputes the rows of a Mosaic forward or dQ, or the keys of a Mosaic
    dK/dV, that a hidden non-finite value reached (those kernels mark them), or None.
    """

    backend: str
    block_q: int = 0
    block_k: int = 0
    num_warps: int = 0
    num_stages: int = 0
    consumers: int = 0
    splits: int = 0
    fused: bool = False
    in_dq: bool = False
    any_order: bool = False
    keys_major: bool = False
    early_q: bool = False
    early_release: bool = False
    declined: tuple[tuple[str, str], ...] = ()
    repair: Route | None = None

    def describe(self, marked: str = "rows") -> str:
        """The backend and tiles; marked names what a repair recomputes ("rows", or the
        dK/dV's "keys")."""
        text = self._tiles()
        if self.repair is None:
            return text
        return f"{text}; marked {marked} recomputed by {self.repair.describe()}"

    def _tiles(self) -> str:
        if self.backend == "xla":
            return "xla"
        if self.fused:
            order = "; batch entries summed in no fixed order" if self.any_order else ""
            return f"{self.backend} (written by the dK/dV kernel{order})"
        if self.in_dq:
            return f"{self.backend} (summed from the dQ kernel's row sums)"
        text = f"{self.backend} {self.block_q}x{self.block_k}"
        if self.backend == "mosaic":
            slots = "1 slot" if self.num_stages == 1 else f"{self.num_stages} slots"
            extra = "".join(note for flag, note in (
                (self.keys_major, ", keys by queries"),
                (self.early_q, ", next Q loaded after the last Q K^T"),
                (self.early_release, ", K/V given back after the last S and dP")) if flag)
            return f"{text}, {slots}, {self.consumers} consumer warpgroups{extra}"
        text = f"{text}, {self.num_warps} warps, {self.num_stages} stages"
        return f"{text}, {self.splits} key splits" if self.backend == "decode" else text


@dataclasses.dataclass(frozen=True)
class Plan:
    """The routes of one call (hashable: kernels are specialised on it).

    programs: how many programs a persistent (Mosaic) kernel launches at most: the
    device's multiprocessors, or 2 in the interpreter (so that programs loop over
    several work items). dbias is None without a bias; its route applies when the
    bias is differentiated.
    """

    implementation: str
    forward: Route
    dq: Route
    dkdv: Route
    dbias: Route | None = None
    programs: int = 0
    device: DeviceInfo | None = None
    interpret: bool = False
    why: str = ""  # why this implementation, when it was chosen automatically
    problem: str = ""  # the call's shapes and features, for the explanation
    head_dims: tuple[int, int] = (0, 0)  # the kernels' padded head dims (q and k, v)

    def route(self, role: str) -> Route | None:
        return getattr(self, role)

    def programs_for(self, work_items: int) -> int:
        """Programs of a persistent kernel with this many work items."""
        return max(1, min(work_items, self.programs))

    def lines(self) -> list[str]:
        """One line per role ("forward", "dQ", "dK/dV", "dbias"), each followed by the
        faster backends it does not run on and why."""
        lines = []
        for role in ROLES:
            route = self.route(role)
            if route is None:
                continue
            # The dK/dV marks keys, and none where dS is also the bias's gradient (it
            # selects the hidden entries itself, `mosaic.dkv.dkdv`).
            marked = ("rows" if role != "dkdv" else "keys" if self.dbias is None
                      else "keys (unless the bias takes a gradient)")
            lines.append(f"{ROLE_LABELS[role]:<8}{route.describe(marked)}")
            lines += [f"{'':<8}  not {backend}: {why}" for backend, why in route.declined]
        return lines

    def __str__(self) -> str:
        head = f"problem: {self.problem}\n" if self.problem else ""
        head += f"implementation: {self.implementation}"
        if self.why:
            head += f" ({self.why})"
        if self.device is not None and self.implementation == "pallas":
            head += f"; device: {self.device.describe()}"
            if self.interpret:
                head += " (interpreted)"
            head += f"; head dims padded to {self.head_dims[0]} and {self.head_dims[1]}"
        return "\n".join([head, *self.lines()])
