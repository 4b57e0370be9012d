"""The routing table: which implementation, and per role which kernel and tiles.

For one call (`Call`: shapes, dtypes, features) and one device, `plan()` decides
the implementation ("pallas", "xla" or "xla_chunked") and, for the kernels, a
`Route` per role: forward, dQ, dK/dV and dbias (when a bias is present). Every
rule that picks a backend lives here, with the reason each faster backend was not
taken; the backends only say what they can run (kernels/*/config.py).

Order of preference per role: the warp-specialised Mosaic GPU kernel (sm90), then
Triton's (sm80 and newer, and the interpreter). Mosaic runs a role where it can and
where it measured faster (docs/decisions.md): every role at head dims padding to 64,
128 and 256 (dbias: 64 and 128). Tiles: the caller's `BlockSizes`, then the
tile cache (`python -m pallas_attn tune`), then the first rung of a ladder that fits
the device's shared memory.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from pallas_attn.device import DeviceInfo, on_nvidia_gpu
from pallas_attn.kernels import mosaic_head_dim, next_power_of_2, padded_head_dim
from pallas_attn.kernels.mosaic import config as mosaic
from pallas_attn.kernels.triton import config as triton
from pallas_attn.plan import BACKEND_FIELDS, ROLE_LABELS, TILE_FIELDS, BlockSizes, Plan, Route
from pallas_attn.spec import (
    KERNEL_DTYPES,
    MAX_KERNEL_HEAD_DIM,
    OPTIONAL_INPUTS,
    AttentionSpec,
    Operands,
)
from pallas_attn.tuning import cache

# The CPU default switches from the reference to the blockwise path where the blockwise
# path became the faster: at T x S = 1024^2 where it skips blocks (causal or a window),
# at 4096 x 2048 without (docs/decisions.md, "The CPU default").
PREFER_CHUNKED_ELEMENTS = 2**20
PREFER_CHUNKED_DENSE_ELEMENTS = 2**23
# The decode kernel: the most query rows (tokens x query heads of a kv group) its one
# tile holds, the programs it aims for per multiprocessor (splitting the keys), its
# tiles, and the fewest key tiles a split takes (docs/decisions.md, "Decode kernel
# tiles and splits").
DECODE_MAX_ROWS = 64
DECODE_PROGRAMS_PER_SM = 2
DECODE_TILES = (64, 4, 3)  # block_k, warps, stages
DECODE_MIN_TILES_PER_SPLIT = 2
# With sequence lengths the Mosaic kernels need the positions past them zeroed in one
# pass over q, k and v first (vjp.prepare): about 400 / (T x group) of the forward's
# time on an H100, so below this many query rows per kv head the Triton kernels (which
# zero in their tiles) run instead (docs/decisions.md, "Sequence lengths in the Mosaic").
MOSAIC_LENGTHS_MIN_ROWS = 2048
# Causal at head dims 97-128 without a bias, mask or segment ids: below this many query rows
# per kv head the Mosaic backward's units and items hold a few steps each, and the
# Triton dQ and dK/dV run the step 17% faster at T = 512 (H200; no gain at 1024 rows or
# at head dim 64; docs/decisions.md, "Short causal problems on the Triton backward").
MOSAIC_CAUSAL_BACKWARD_MIN_ROWS = 1024


@dataclasses.dataclass(frozen=True)
class Call:
    """What routing depends on: the shapes, dtypes and features of one call."""

    spec: AttentionSpec
    batch: int
    q_len: int
    kv_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    value_head_dim: int
    dtype: str
    bias_dtype: str | None = None
    present: tuple[str, ...] = ()  # the optional inputs given (spec.OPTIONAL_INPUTS)

    @staticmethod
    def of(spec: AttentionSpec, ops: Operands) -> Call:
        B, T, N, H = ops.query.shape
        _, S, K, _ = ops.key.shape
        return Call(spec, B, T, S, N, K, H, ops.value.shape[-1], jnp.dtype(ops.query.dtype).name,
                    None if ops.bias is None else jnp.dtype(ops.bias.dtype).name,
                    tuple(name for name in OPTIONAL_INPUTS if getattr(ops, name) is not None))

    def describe(self) -> str:
        heads = f"N={self.num_heads}" + (f"/{self.num_kv_heads}"
                                         if self.num_kv_heads != self.num_heads else "")
        dims = f"H={self.head_dim}" + (f" Hv={self.value_head_dim}"
                                       if self.value_head_dim != self.head_dim else "")
        spec = self.spec
        features = [name for name, on in (
            ("causal" if spec.causal_alignment == "top_left" else "causal bottom-right",
             spec.is_causal),
            (f"window {spec.local_window}", spec.local_window is not None),
            (f"soft cap {spec.logits_soft_cap}", spec.logits_soft_cap is not None),
            (f"dropout {spec.dropout_rate}", spec.has_dropout)) if on]
        features += [f"bias {list(spec.bias_shape)} {self.bias_dtype}"] if spec.has_bias else []
        features += [name for name in self.present if name not in ("bias", "dropout_keys")]
        return (f"B={self.batch} T={self.q_len} S={self.kv_len} {heads} {dims} {self.dtype}"
                + "".join(f", {f}" for f in features))


def choose_implementation(implementation: str | None, call: Call, interpret: bool,
                          device: DeviceInfo | None = None) -> tuple[str, str]:
    """(implementation, why) for a requested one (None: automatic); device: the GPU a
    caller plans for (then the kernels)."""
    if implementation is not None:
        return implementation, ""
    if device is not None:
        return "pallas", "planning for the device given"
    if interpret:
        return "pallas", "interpret=True runs the Pallas kernels in the interpreter"
    if on_nvidia_gpu() and call.dtype in KERNEL_DTYPES:
        return "pallas", "an NVIDIA GPU"
    if on_nvidia_gpu():
        return "xla", f"{call.dtype} inputs: the kernels take {', '.join(KERNEL_DTYPES)}"
    skips = call.spec.is_causal or call.spec.local_window is not None
    threshold = PREFER_CHUNKED_ELEMENTS if skips else PREFER_CHUNKED_DENSE_ELEMENTS
    if call.q_len * call.kv_len >= threshold:
        return "xla_chunked", (f"no NVIDIA GPU, and T * S >= 2**{threshold.bit_length() - 1}"
                               f"{' with blocks to skip' if skips else ''}, where the "
                               f"blockwise path is the faster")
    return "xla", "no NVIDIA GPU: the reference"


def plan(call: Call, *, implementation: str = "pallas", device: DeviceInfo | None = None,
         block_sizes: BlockSizes | None = None, interpret: bool = False,
         why: str = "") -> Plan:
    """The plan of one call. device: the GPU to plan for (None: the current one, or an
    H100's description in the interpreter). ValueError when block_sizes asks for
    something the table cannot give, naming the field."""
    if implementation != "pallas":
        if block_sizes is not None or interpret:
            raise ValueError(f"block_sizes and interpret apply to implementation='pallas', "
                             f"got {implementation!r}")
        xla = Route("xla")
        return Plan(implementation, xla, xla, xla, xla if call.spec.has_bias else None, why=why,
                    problem=call.describe())
    _check_kernels_run(call, interpret, device)
    if device is None:
        device = DeviceInfo() if interpret else DeviceInfo.current()
    overrides = block_sizes or BlockSizes()
    if refusal := _not_hopper(device):
        for role, field in BACKEND_FIELDS.items():
            if overrides.backend(role) == "mosaic":  # even where the role does not run
                raise ValueError(
                    f"block_sizes.{field}='mosaic' does not cover this call: {refusal}")
    tiles = _triton_tiles(call, device, overrides, interpret)
    decode = _decode_route(call, device, overrides, interpret)
    # The Mosaic routes are sized at the head dims their kernels run at: whole wgmma tiles
    # where every role is a Mosaic kernel, else powers of two (`_every_role_mosaic`).
    dims = (mosaic_head_dim(call.head_dim), mosaic_head_dim(call.value_head_dim))
    routes, dbias = _routes(call, device, overrides, interpret, tiles, decode, dims)
    powers = (padded_head_dim(call.head_dim), padded_head_dim(call.value_head_dim))
    if dims != powers and not _every_role_mosaic(routes, dbias):
        dims = powers
        routes, dbias = _routes(call, device, overrides, interpret, tiles, decode, dims)
    return Plan("pallas", routes["forward"], routes["dq"], routes["dkdv"], dbias,
                programs=2 if interpret else device.num_multiprocessors, device=device,
                interpret=interpret, why=why, problem=call.describe(), head_dims=dims)


def _routes(call: Call, device: DeviceInfo, overrides: BlockSizes, interpret: bool,
            tiles: dict[str, triton.Tiles], decode: Route | str, dims: tuple[int, int]
            ) -> tuple[dict[str, Route], Route | None]:
    """Each role's route (dbias apart, None without a bias), the Mosaic ones sized for
    kernels at head dims dims."""
    routes = {role: _route(role, call, device, overrides, interpret, tiles[role], dims)
              for role in ("dkdv", "dq")}
    if isinstance(decode, Route):
        routes["forward"] = decode
    else:
        forward = _route("forward", call, device, overrides, interpret, tiles["forward"], dims)
        if decode:  # a few query rows: say why the decode kernel does not take them
            forward = dataclasses.replace(forward,
                                          declined=(("decode", decode), *forward.declined))
        routes["forward"] = forward
    if call.spec.hides_keys:
        # The Mosaic forward and dQ kernels feed whole key tiles to the tensor cores: a
        # hidden non-finite key reaches the rows sharing its tile, which they mark and a
        # Triton kernel recomputes (docs/decisions.md, "marked and repaired"). The Mosaic
        # dK/dV takes a mask and ids into the scores alone (its mask tile dead before the
        # gradient math): it marks the keys a row with a NaN or a hidden non-finite
        # value reached, for a Triton kernel to recompute.
        keys_marked = call.spec.has_mask or call.spec.has_segments
        for role in ("forward", "dq", "dkdv"):
            if routes[role].backend == "mosaic" and (role != "dkdv" or keys_marked):
                routes[role] = dataclasses.replace(
                    routes[role], repair=Route("triton", *triton.REPAIR_TILES))
    dbias = (_dbias_route(call, device, overrides, interpret, tiles["dbias"], routes["dkdv"],
                          routes["dq"], dims) if call.spec.has_bias else None)
    return routes, dbias


def _every_role_mosaic(routes: dict[str, Route], dbias: Route | None) -> bool:
    """Whether the kernels may run at whole-tile head dims (`mosaic_head_dim`: 48, 80,
    160): the forward, dQ and dK/dV are Mosaic kernels and dbias is none or the dK/dV
    kernel's (the Triton repairs read such heads in place, `triton.context.head_tile`);
    the other Triton kernels and the dbias kernels need powers of two."""
    return (all(route.backend == "mosaic" for route in routes.values())
            and (dbias is None or dbias.fused or dbias.in_dq))


def _check_kernels_run(call: Call, interpret: bool, device: DeviceInfo | None) -> None:
    """ValueError, saying what to use instead, for a call the kernels cannot run."""
    if not interpret and device is None and not on_nvidia_gpu():
        raise ValueError(
            "implementation='pallas' runs the kernels on an NVIDIA GPU and this machine has "
            "none: pass interpret=True to run them in the Pallas interpreters, or use "
            "implementation='xla'; to lower for a GPU from here, trace inside "
            "pallas_attn.device.lowering_for(pallas_attn.DeviceInfo(...))")
    if call.dtype not in KERNEL_DTYPES:
        raise ValueError(f"the Pallas kernels take {', '.join(KERNEL_DTYPES)} inputs, got "
                         f"{call.dtype}; use implementation='xla' or 'xla_chunked'")
    if max(call.head_dim, call.value_head_dim) > MAX_KERNEL_HEAD_DIM:
        raise ValueError(
            f"the Pallas kernels support head dims up to {MAX_KERNEL_HEAD_DIM}, got "
            f"query/key {call.head_dim} and value {call.value_head_dim}; use "
            f"implementation='xla'")


# ------------------------------------------------------------------ Triton tiles
def _heavy_scores(call: Call) -> bool:
    spec = call.spec
    return spec.has_bias or spec.has_dropout or spec.logits_soft_cap is not None


def _triton_tiles(call: Call, device: DeviceInfo, overrides: BlockSizes, interpret: bool
                  ) -> dict[str, triton.Tiles]:
    """Each role's Triton tiles: the overrides over the cached or the heuristic ones."""
    spec = call.spec
    budget = device.max_shared_memory_per_block
    smem = dict(bias_dtype=call.bias_dtype, has_mask=spec.has_mask)
    features = {"is_causal": spec.is_causal, "has_bias": spec.has_bias,
                "has_dropout": spec.has_dropout, "has_window": spec.local_window is not None}
    tuned = None if interpret else cache.lookup(device, call.dtype, call.head_dim,
                                                call.value_head_dim, call.q_len, call.kv_len,
                                                features)
    chosen = {}
    for role in ("forward", "dkdv", "dq", *(("dbias",) if spec.has_bias else ())):
        def need(tiles, role=role):
            cleaned = triton.cleaned_tiles(role, spec.hides_keys, spec.has_q_lengths,
                                           spec.has_kv_lengths, call.kv_len, tiles[1])
            return triton.shared_memory(role, tiles, call.head_dim, call.value_head_dim,
                                        call.dtype, cleaned=cleaned, **smem)

        def fits(tiles, need=need):
            return need(tiles) <= budget

        cached = (None if tuned is None or None in tuned.tiles(role)
                  else triton.clamp(tuned.tiles(role), call.q_len, call.kv_len))
        # The cache keys no mask or segments: tiles tuned without them may not fit.
        if cached is not None and fits(cached):
            base = cached
        else:
            rungs = triton.ladder(role, call.head_dim, call.value_head_dim, spec.is_causal,
                                  _heavy_scores(call))
            clamped = (triton.clamp(rung, call.q_len, call.kv_len) for rung in rungs)
            base = next((rung for rung in clamped if fits(rung)), None)
            if base is None:
                raise ValueError(
                    f"no tile size of the {ROLE_LABELS[role]} kernel fits {budget} bytes of "
                    f"shared memory (head dims {call.head_dim}/{call.value_head_dim}, "
                    f"{call.dtype}); pass block_sizes")
        given = overrides.tiles(role)
        if any(x is not None for x in given):
            tiles = triton.clamp(tuple(b if g is None else g for g, b in zip(given, base,
                                                                               strict=True)),
                                 call.q_len, call.kv_len)
            if not interpret and not fits(tiles):
                raise ValueError(
                    f"block_sizes {_fields(role, tiles)} need about {need(tiles)} bytes of shared "
                    f"memory in the {ROLE_LABELS[role]} kernel (head dims {call.head_dim}/"
                    f"{call.value_head_dim}, {call.dtype}), over the device's {budget} bytes "
                    f"per block; choose smaller tiles or fewer stages")
            base = tiles
        chosen[role] = base
    return chosen


def _fields(role: str, tiles: tuple) -> str:
    return ", ".join(f"{f}={t}" for f, t in zip(TILE_FIELDS[role], tiles, strict=True))


# ------------------------------------------------------------------ Mosaic routes
def _not_hopper(device: DeviceInfo) -> str:
    if device.is_hopper:
        return ""
    major, minor = device.compute_capability
    return f"needs an sm90 (Hopper) GPU, this one is sm{major}{minor}"


def _first_fitting(options: tuple[int, ...], need: Any, device: DeviceInfo) -> tuple[int, int]:
    """(slots, bytes): the first of options whose buffers, need(slots) bytes, fit the
    device's shared memory, else the last."""
    needs = {s: need(s) for s in options}
    slots = next((s for s in options if needs[s] <= device.max_shared_memory_per_block),
                 options[-1])
    return slots, needs[slots]


def _mosaic_route(role: str, call: Call, device: DeviceInfo, overrides: BlockSizes,
                  automatic: bool, interpret: bool, dims: tuple[int, int]) -> Route | str:
    """The Mosaic kernel's route for a role at padded head dims dims, or why it does not
    run it."""
    spec = call.spec
    if why := _not_hopper(device):
        return why
    if automatic and interpret:
        return ("the interpreter runs the Triton kernels unless block_sizes names the "
                "Mosaic ones")
    if why := mosaic.unsupported(call.dtype, spec, call.present, call.head_dim,
                                 call.value_head_dim, role):
        return why
    hp, hvp = dims
    if automatic and call.q_len < mosaic.ITEM_ROWS:
        return f"fewer query rows ({call.q_len}) than one work item ({mosaic.ITEM_ROWS})"
    rows = call.q_len * (call.num_heads // call.num_kv_heads)
    lengths = [name for name in ("query_seq_lengths", "key_value_seq_lengths")
               if name in call.present]
    if automatic and lengths and rows < MOSAIC_LENGTHS_MIN_ROWS:
        return (f"with {lengths[0]} the Mosaic kernels need a pass that zeroes the "
                f"positions past the lengths, which costs more than they save below "
                f"{MOSAIC_LENGTHS_MIN_ROWS} query rows per kv head (T x group = {rows}; "
                f"docs/decisions.md)")
    # (Where no row sees a key past T: bottom-right alignment with S > T lets every row
    # see the earlier keys, long units the Mosaic kernels keep; so do ring attention's
    # blocks, most of them whole.)
    if (automatic and role in ("dq", "dkdv") and spec.is_causal
            and all(96 < d <= 128 for d in dims)
            and rows < MOSAIC_CAUSAL_BACKWARD_MIN_ROWS
            and spec.offset(call.q_len, call.kv_len) <= 0 and "origin" not in call.present
            and not (spec.has_bias or spec.has_mask or spec.has_segments)):
        return (f"causal with {rows} query rows per kv head (under "
                f"{MOSAIC_CAUSAL_BACKWARD_MIN_ROWS}): the Triton backward measured faster "
                f"on such short units (docs/decisions.md)")
    # NOTE: with segment ids one Mosaic backward kernel measured faster next to the other
    # role's Triton one: dQ under causal masking, dK/dV without (docs/decisions.md); but
    # dQ stays Mosaic with a bias broadcast along keys, whose gradient its row sums give.
    triton_with_segments = "dkdv" if spec.is_causal else "dq"
    row_sums = role == "dq" and spec.has_bias and spec.bias_shape[-1] == 1
    if (automatic and "q_segment_ids" in call.present and role == triton_with_segments
            and not row_sums):
        return (f"segment ids: the Triton {ROLE_LABELS[role]} kernel (finer tiles to skip) "
                f"measured faster with them (docs/decisions.md)")
    block_q, block_k, _, stages = overrides.tiles(role)
    # A bias or mask per key is read from global memory: no tiles of it in shared memory.
    bias_dtype, has_mask = mosaic.bias_tiles_dtype(spec, call.bias_dtype), mosaic.mask_tiles(spec)
    if role == "forward":
        wrong = (block_q not in (None, mosaic.ITEM_ROWS)
                 or block_k not in (None, *mosaic.FORWARD_BLOCK_K)
                 or (stages is not None and stages < 2))
        rule = (f"block_q={mosaic.ITEM_ROWS}, block_k in {mosaic.FORWARD_BLOCK_K} and "
                f"num_stages >= 2")
        stages = stages or mosaic.FORWARD_STAGES
        budget = device.max_shared_memory_per_block
        options = (block_k,) if block_k else mosaic.forward_block_k_options(
            hp, hvp, key_operands=spec.has_bias or spec.has_mask or spec.has_segments)
        for block_k in options:  # the first that fits, else the last (refused below)
            consumers = mosaic.forward_consumers(hp, hvp, block_k, stages, call.dtype,
                                                 bias_dtype=bias_dtype, budget=budget,
                                                 has_mask=has_mask)
            staging = mosaic.forward_output_staging(hp, hvp, block_k, stages, call.dtype,
                                                    bias_dtype, budget, consumers, has_mask)
            need = mosaic.forward_scratch(hp, hvp, block_k, stages, call.dtype, bias_dtype,
                                          staging=staging, consumers=consumers,
                                          has_mask=has_mask).bytes
            if need <= budget:
                break
        route = Route("mosaic", mosaic.ITEM_ROWS, block_k, 0, stages, consumers,
                      early_q=staging != "q" and mosaic.forward_loads_q_early(spec))
    elif role == "dkdv":
        dkv_tiles = mosaic.dkv_tiles(hp, hvp)
        wrong = block_q not in (None, dkv_tiles[0]) or block_k not in (None, dkv_tiles[1])
        rule = f"(block_q_dkv, block_k_dkv) = {dkv_tiles}"
        stages, need = _first_fitting(
            (stages,) if stages is not None else mosaic.DKV_STAGE_OPTIONS,
            lambda s: mosaic.dkv_scratch(hp, hvp, s, call.dtype, bias_dtype,
                                         zeros=bias_dtype is not None, has_mask=has_mask,
                                         ones=mosaic.key_sums(spec)).bytes,
            device)
        route = Route("mosaic", *dkv_tiles, 0, stages, mosaic.CONSUMERS,
                      keys_major=mosaic.dkv_keys_major(hp, hvp, spec.has_bias, spec.has_alibi,
                                                       has_mask),
                      early_release=mosaic.dkv_releases_early(spec))
    elif role == "dq":
        dq_tiles = mosaic.dq_tiles(hp, hvp)
        wrong = (block_q not in (None, dq_tiles[0]) or block_k not in (None, dq_tiles[1])
                 or (stages is not None and stages < 2))
        rule = f"(block_q_dq, block_k_dq) = {dq_tiles} and num_stages_dq >= 2"
        stages = stages or mosaic.DQ_STAGES
        consumers = mosaic.dq_consumers(
            hp, hvp, dq_tiles[1], stages, call.dtype, bias_dtype=bias_dtype,
            has_window=spec.local_window is not None,
            budget=device.max_shared_memory_per_block, has_mask=has_mask,
            has_segments=spec.has_segments)
        route = Route("mosaic", *dq_tiles, 0, stages, consumers)
        need = mosaic.dq_scratch(hp, hvp, dq_tiles[1], stages, consumers, call.dtype,
                                 bias_dtype, dbias=bias_dtype is not None,
                                 has_mask=has_mask).bytes
    else:  # dbias
        wrong = (block_q not in (None, mosaic.ITEM_ROWS)
                 or block_k not in (None, *mosaic.DBIAS_BLOCK_K))
        rule = f"block_q_dbias={mosaic.ITEM_ROWS} and block_k_dbias in {mosaic.DBIAS_BLOCK_K}"
        block_k = block_k or mosaic.DBIAS_BLOCK_K[0]
        stages, need = _first_fitting(
            (stages,) if stages is not None else mosaic.DBIAS_STAGES,
            lambda s: mosaic.dbias_scratch(hp, hvp, block_k, s, call.dtype,
                                           call.bias_dtype).bytes, device)
        route = Route("mosaic", mosaic.ITEM_ROWS, block_k, 0, stages, mosaic.CONSUMERS)
    if wrong:
        given = _fields(role, overrides.tiles(role))
        return f"it runs {rule}; block_sizes gives {given}"
    budget = device.max_shared_memory_per_block
    if need > budget and (automatic or not interpret):
        return (f"its buffers need {need} bytes of shared memory, over the device's "
                f"{budget} per block")
    return route


def _route(role: str, call: Call, device: DeviceInfo, overrides: BlockSizes, interpret: bool,
           tiles: triton.Tiles, dims: tuple[int, int]) -> Route:
    forced = overrides.backend(role)
    declined = ()
    if forced != "triton":
        mosaic_route = _mosaic_route(role, call, device, overrides, forced is None, interpret,
                                     dims)
        if isinstance(mosaic_route, Route):
            return mosaic_route
        if forced == "mosaic":
            field = f"block_sizes.{BACKEND_FIELDS[role]}"
            raise ValueError(f"{field}='mosaic' does not cover this call: {mosaic_route}")
        declined = (("mosaic", mosaic_route),)
    return Route("triton", *tiles, declined=declined)


# ------------------------------------------------------------------ decode
def _decode_route(call: Call, device: DeviceInfo, overrides: BlockSizes, interpret: bool
                  ) -> Route | str:
    """The split-key decode kernel's forward route; else why it does not run a call of
    a few query rows ("" for more rows than its tile holds, where it is no candidate)."""
    forced = overrides.backend("forward")
    rows = call.q_len * (call.num_heads // call.num_kv_heads)
    if forced not in (None, "decode"):
        return f"block_sizes.forward_backend={forced!r}" if rows <= DECODE_MAX_ROWS else ""
    others = [name for name in call.present if name not in triton.DECODE_OPERANDS]
    why = ""
    if others or call.spec.has_dropout:
        why = ("it reads no operand besides q, k, v, a bias, a mask, ALiBi slopes, sinks "
               "and lengths, got "
               f"{', '.join(others or ['dropout'])}")
    elif rows > DECODE_MAX_ROWS and forced is None:
        why = (f"its tile holds at most {DECODE_MAX_ROWS} query rows (tokens x query heads "
               f"per kv head), got {rows}: tiles of them would each read the keys again")
    if why and forced == "decode":
        raise ValueError(f"block_sizes.forward_backend='decode' does not cover this call: {why}")
    if why:
        return why if rows <= DECODE_MAX_ROWS else ""
    block_q, block_k, warps, stages = overrides.tiles("forward")
    if block_q is not None and forced == "decode":
        raise ValueError("block_sizes.block_q does not apply to the decode kernel (its tile "
                         "holds every query row of a kv group)")
    if block_q is not None:
        return f"block_sizes.block_q={block_q} sets the forward kernel's query tile"
    chosen = forced == "decode" or block_k is not None or stages is not None
    block_k = block_k or DECODE_TILES[0]
    warps = warps or DECODE_TILES[1]
    budget = device.max_shared_memory_per_block
    rows_pad = min(DECODE_MAX_ROWS, max(16, next_power_of_2(rows)))
    row_tiles = -(-rows // rows_pad)
    options = (stages,) if stages is not None else (DECODE_TILES[2], 1)

    def need(s):  # a bias's and a mask's tiles are staged beside K and V
        return triton.shared_memory("forward", (rows_pad, block_k, warps, s), call.head_dim,
                                    call.value_head_dim, call.dtype,
                                    bias_dtype=call.bias_dtype, has_mask=call.spec.has_mask)

    stages = next((s for s in options if need(s) <= budget), options[-1])
    if need(stages) > budget and not interpret:
        why = (f"the decode kernel with block_k={block_k} and {stages} stages needs "
               f"{need(stages)} bytes of shared memory, over the device's {budget}")
        if chosen:
            raise ValueError(why)
        return why
    key_tiles = -(-call.kv_len // block_k)
    programs = DECODE_PROGRAMS_PER_SM * (2 if interpret else device.num_multiprocessors)
    # At most `programs` in all (rounding up left a few multiprocessors a program more
    # than the rest, the whole launch waiting on them).
    splits = max(1, min(key_tiles // DECODE_MIN_TILES_PER_SPLIT,
                        programs // (call.batch * call.num_kv_heads * row_tiles)))
    return Route("decode", rows_pad, block_k, warps, stages, splits=splits)


# ------------------------------------------------------------------ ring and paged calls
def ring_implementation(implementation: str | None, interpret: bool) -> str:
    """ring_attention's block implementation: the kernels on an NVIDIA GPU (or in the
    interpreter), else the blockwise path (the reference holds T x S per block)."""
    if implementation is not None:
        return implementation
    return "pallas" if interpret or on_nvidia_gpu() else "xla_chunked"


def paged_implementation(implementation: str | None, interpret: bool, why_not_kernel: str,
                         q_len: int, capacity: int) -> str:
    """paged_attention's implementation: the decode kernel reading the pages in place
    where it can (why_not_kernel empty), else a jnp path on the gathered pages: the
    blockwise one where T x capacity reaches the causal CPU default's threshold (no
    T x S scores), the reference below it."""
    if implementation is not None:
        return implementation
    if (interpret or on_nvidia_gpu()) and not why_not_kernel:
        return "pallas"
    return "xla_chunked" if q_len * capacity >= PREFER_CHUNKED_ELEMENTS else "xla"


def paged_kernel_refusal(head_dim: int, value_head_dim: int) -> str:
    """Why the decode kernel cannot read a paged cache in place, or ""."""
    for name, dim in (("query/key", head_dim), ("value", value_head_dim)):
        if dim > MAX_KERNEL_HEAD_DIM:
            return (f"the paged kernel takes head dims up to {MAX_KERNEL_HEAD_DIM}, got "
                    f"{name} {dim}")
    return ""


# ------------------------------------------------------------------ dbias
def _fusable(call: Call, dkdv: Route) -> bool:
    shape = call.spec.bias_shape
    if dkdv.backend == "mosaic":
        return mosaic.fusable_dbias(shape, batch=call.batch, num_heads=call.num_heads,
                                    bias_dtype=call.bias_dtype, dtype=call.dtype)
    return triton.fusable_dbias(shape, batch=call.batch, num_heads=call.num_heads)


def _in_turn_too_narrow(call: Call, device: DeviceInfo, overrides: BlockSizes,
                        dims: tuple[int, int]) -> str:
    """Why a batch-shared bias's gradient, summed in turn by the Mosaic dK/dV kernel (one
    batch entry per pass), would leave SMs idle: each pass has fewer work items than the
    device has SMs, and the separate dbias kernel measured faster there
    (docs/decisions.md, "Batch-shared dbias summed in turn"); "" where it would not."""
    if not overrides.deterministic or not mosaic.sums_batch_tiles(call.spec, call.batch):
        return ""
    unit = mosaic.dkv_tiles(*dims)[1]
    items = -(-call.kv_len // unit) * call.num_kv_heads
    if items >= device.num_multiprocessors:
        return ""
    return (f"summed in turn over {call.batch} batch entries, each pass has {items} dK/dV "
            f"work items for the device's {device.num_multiprocessors} SMs")


def _dbias_route(call: Call, device: DeviceInfo, overrides: BlockSizes, interpret: bool,
                 tiles: triton.Tiles, dkdv: Route, dq: Route, dims: tuple[int, int]) -> Route:
    """dbias: written by the dK/dV kernel where it can (fused), else its own kernel.

    Automatic fusion: where the Mosaic dK/dV kernel can (docs/decisions.md,
    "dbias fused into the Mosaic dK/dV kernel"), a batch-shared bias's sum in a fixed
    order unless BlockSizes.deterministic is False, but for the separate Mosaic dbias
    kernel where that order's passes are too narrow (`_in_turn_too_narrow`); with
    Triton's where it can and its grid has a program per multiprocessor (summing a
    broadcast bias's dS inside it measured slower than the dbias kernel). A bias
    broadcast along keys: summed from the Mosaic dQ kernel's row sums where dQ is that
    kernel (it holds every key of its rows; the dbias kernel recomputes S and dP)."""
    shape = call.spec.bias_shape
    fusable = _fusable(call, dkdv)
    if overrides.fuse_dbias and not fusable:
        if dkdv.backend == "mosaic":
            raise ValueError(
                f"BlockSizes.fuse_dbias=True with the Mosaic dK/dV kernel needs a bias of "
                f"shape ({call.batch} or 1, {call.num_heads}, T, S) in the inputs' dtype "
                f"{call.dtype}; this bias has shape {shape} and dtype {call.bias_dtype}: use "
                f"fuse_dbias=None or False")
        raise ValueError(
            f"BlockSizes.fuse_dbias=True needs a bias with its own entry for every batch "
            f"entry, head and key ({call.batch}, {call.num_heads}, T or 1, S); this bias has "
            f"shape {shape}: use fuse_dbias=None or False")
    declined, separate = [], None
    if shape[-1] == 1 and not fusable and overrides.backend("dbias") != "triton":
        if dq.backend == "mosaic":
            return dataclasses.replace(dq, in_dq=True, declined=(), repair=None)
        declined.append(("mosaic", "a bias broadcast along keys takes its gradient from the "
                         "Mosaic dQ kernel's row sums, and dQ runs on Triton"))
    if overrides.fuse_dbias is not None:
        fused = overrides.fuse_dbias
    elif dkdv.backend == "mosaic":
        fused = fusable
        reason = _in_turn_too_narrow(call, device, overrides, dims) if fusable else ""
        if reason:
            separate = _route("dbias", call, device, overrides, interpret, tiles, dims)
            if separate.backend == "mosaic":
                fused = False
                declined.append(("fused", reason))
    else:
        programs = -(-call.kv_len // dkdv.block_k) * call.batch * call.num_kv_heads
        fused = fusable and programs >= device.num_multiprocessors
        if fusable and not fused:
            declined.append(("fused", f"the dK/dV grid ({programs} programs) has fewer "
                             f"programs than the device's {device.num_multiprocessors} SMs"))
    if fused:
        # Concurrent programs summing a batch-shared bias's dS by reduce-add copies:
        # only when asked (docs/decisions.md, "Batch-shared dbias summed in turn").
        any_order = (not overrides.deterministic and dkdv.backend == "mosaic"
                     and mosaic.sums_batch_tiles(call.spec, call.batch))
        return dataclasses.replace(dkdv, fused=True, any_order=any_order, declined=(),
                                   repair=None)
    if not fusable and overrides.fuse_dbias is None:
        declined.append(("fused", f"the {dkdv.backend} dK/dV kernel cannot write the gradient "
                         f"of a bias of shape {shape}, {call.bias_dtype}"))
    if separate is None:
        separate = _route("dbias", call, device, overrides, interpret, tiles, dims)
    said = {backend for backend, _ in declined}
    return dataclasses.replace(separate, declined=(
        *declined, *((backend, why) for backend, why in separate.declined if backend not in said)))


# ------------------------------------------------------------------ the matrix
_MATRIX_ROWS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("plain, head dim 128", {}),
    ("plain, head dim 64", dict(head_dim=64)),
    ("head dims 8-32 (padded to 16 or 32)", dict(head_dim=24)),
    ("head dims 33-112 (padded to a multiple of 16)", dict(head_dim=80)),
    ("head dims 113-128 (padded to 128)", dict(head_dim=120)),
    ("head dims 129-256 (padded to a multiple of 32)", dict(head_dim=160)),
    ("causal (either alignment), window, soft cap, ALiBi",
     dict(is_causal=True, logits_soft_cap=30.0, has_alibi=True)),
    ("causal, head dim 128, T = S = 512 (under 1024 query rows per kv head)",
     dict(is_causal=True, length=512)),
    ("bias [1, N, T, S] or [B, N, T, S], 16-bit", dict(bias_shape=(1, 16, 4096, 4096))),
    ("bias [1, 1, T, S] (shared by heads)", dict(bias_shape=(1, 1, 4096, 4096))),
    ("bias [B, N, 1, S] (per key)", dict(bias_shape=(4, 16, 1, 4096))),
    ("bias [B, N, T, 1] (per row)", dict(bias_shape=(4, 16, 4096, 1))),
    ("bias in float32", dict(bias_shape=(1, 16, 4096, 4096), bias_dtype="float32")),
    ("boolean mask [B, 1, T, S]", dict(mask_shape=(4, 1, 4096, 4096))),
    ("boolean mask [B, 1, 1, S] (per key)", dict(mask_shape=(4, 1, 1, 4096))),
    ("boolean mask [B, 1, T, 1] (per row)", dict(mask_shape=(4, 1, 4096, 1))),
    ("segment ids", dict(present=("q_segment_ids", "kv_segment_ids"))),
    ("segment ids, causal", dict(is_causal=True, present=("q_segment_ids", "kv_segment_ids"))),
    ("sequence lengths", dict(present=("query_seq_lengths", "key_value_seq_lengths"))),
    ("dropout", dict(dropout_rate=0.1)),
    ("float32 inputs", dict(dtype="float32")),
)


def _matrix_call(head_dim: int = 128, dtype: str = "bfloat16", present: tuple = (),
                 bias_dtype: str | None = None, has_alibi: bool = False, length: int = 4096,
                 **spec_fields: Any) -> Call:
    spec = AttentionSpec(scale=head_dim ** -0.5, has_alibi=has_alibi, **spec_fields)
    names = set(present)
    names |= {"bias"} if spec.has_bias else set()
    names |= {"mask"} if spec.has_mask else set()
    names |= {"alibi_slopes"} if has_alibi else set()
    names |= {"dropout_keys"} if spec.has_dropout else set()
    if spec.has_bias and bias_dtype is None:
        bias_dtype = dtype
    if "q_segment_ids" in names:
        spec = dataclasses.replace(spec, has_segments=True)
    if "query_seq_lengths" in names:
        spec = dataclasses.replace(spec, has_q_lengths=True, has_kv_lengths=True)
    return Call(spec, 4, length, length, 16, 16, head_dim, head_dim, dtype, bias_dtype,
                tuple(name for name in OPTIONAL_INPUTS if name in names))


def support_matrix(device: DeviceInfo | None = None) -> str:
    """The backend of each role for representative problems on a device (default: an
    H100), as a Markdown table; B=4, T=S=4096, N=16, bf16 unless the row says."""
    device = device or DeviceInfo()
    lines = ["| problem | forward | dQ | dK/dV | dbias |", "|---|---|---|---|---|"]
    for label, fields in _MATRIX_ROWS:
        p = plan(_matrix_call(**fields), device=device)
        cells = []
        for role in ("forward", "dq", "dkdv", "dbias"):
            route = p.route(role)
            if route is None:
                cells.append("-")
            elif route.fused:
                cells.append(f"{route.backend} (in dK/dV)")
            elif route.in_dq:
                cells.append(f"{route.backend} (in dQ)")
            else:
                cells.append(route.backend)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
