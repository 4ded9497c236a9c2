"""The static TP layout: for R ranks, which slice of every checkpoint tensor each rank holds.

Rules (docs/distribution.md, "Who holds what"), per module:
- attention heads split contiguously, earlier ranks take the extra head (64/4 = 16; 64/3 = 22/21/21):
  q_b_proj and kv_b_proj by output rows of their heads, o_proj by input columns of its heads;
- the latent path is replicated: q_a_proj, kv_a_proj_with_mqa and their norms (every rank needs the
  whole latent, and the cache stores the latent, not per-head keys);
- the sparse indexer is replicated: under DCP each rank scores its own token positions with all
  indexer heads (scores are summed over heads before the global top-k), and it is small (~9 M
  parameters a layer), so splitting its heads would only add a per-position all-reduce;
- routed experts, the shared expert and the dense MLP split their intermediate in 128-column blocks
  (2048 = 16 blocks: 4/4/4/4; over 3 ranks 6/5/5, the extra block going to rank (layer % R) and then
  onward, so no rank carries the surplus on every layer): gate/up by output, down by input;
- embedding and LM head split by vocabulary (contiguous, earlier ranks take the extra row);
- norms, the router, MTP's enorm/hnorm/eh_proj replicated.

EXL3 linears (`trellis [in/16, out/16, 16K]`, `suh [in]`, `svh [out]`) split by whole 16x16 tiles;
the Hadamard transform works on 128-blocks of both axes, so a rank's read range is its own range
widened to 128-blocks. When that widening happens (kv_b_proj's 448-row heads over 3 ranks) the rank
computes the extra outputs and drops them (output split) or feeds zeros for them (input split):
`FeatureSplit.own` is what it owns, `FeatureSplit.read` what it reads.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Literal

from glm53.formats.checkpoint_rules import LINEAR_PARTS
from glm53.config import Glm53Config
from glm53.formats.safetensors_header import TensorInfo, read_header

BLOCK = 128  # expert/MLP intermediate block, and the EXL3 Hadamard block
TILE = 16  # EXL3 tile edge
MAX_RANKS = 8
INDEX_NAME = "model.safetensors.index.json"

Axis = Literal["out", "in"]


class PlanError(ValueError):
    """A checkpoint or rank count the layout cannot split; the message names the tensor and the remedy."""


@dataclass(frozen=True)
class SliceSpec:
    """Rows [start, stop) of dimension `dim` of the stored tensor."""
    dim: int
    start: int
    stop: int


@dataclass(frozen=True)
class FeatureSplit:
    """How one rank holds one module's split axis, in feature units of that axis."""
    axis: Axis
    own: tuple[int, int]
    read: tuple[int, int]
    total: int


@dataclass(frozen=True)
class ModuleRule:
    kind: str  # "heads" | "blocks" | "vocab" | "replicated"
    axis: Axis | None = None
    unit: int = 1  # features per head / block
    layer: int | None = None  # blocks: the extra block goes to rank layer % R first


@dataclass(frozen=True)
class TensorLocation:
    file: str  # absolute path of the shard
    data_offset: int  # file offset of the shard's data buffer


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_LINEAR_SUFFIXES = LINEAR_PARTS
_REPLICATED = re.compile(
    r"^(model\.norm\.weight"
    r"|model\.layers\.\d+\.(input_layernorm|post_attention_layernorm|enorm|hnorm|shared_head\.norm)\.weight"
    r"|model\.layers\.\d+\.eh_proj\.\w+"
    r"|model\.layers\.\d+\.self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.\w+"
    r"|model\.layers\.\d+\.self_attn\.(q_a_layernorm|kv_a_layernorm)\.weight"
    r"|model\.layers\.\d+\.self_attn\.indexer\.[\w.]+"
    r"|model\.layers\.\d+\.mlp\.gate\.(weight|e_score_correction_bias))$"
)


@lru_cache(maxsize=4096)
def split_units(n_units: int, ranks: int, first_extra: int = 0) -> tuple[tuple[int, int], ...]:
    """Contiguous [start, stop) unit ranges per rank; the n % R extra units go to ranks
    first_extra, first_extra + 1, ... (mod R)."""
    base, extra = divmod(n_units, ranks)
    lucky = {(first_extra + j) % ranks for j in range(extra)}
    out, start = [], 0
    for r in range(ranks):
        stop = start + base + (1 if r in lucky else 0)
        out.append((start, stop))
        start = stop
    return tuple(out)


def _module_and_suffix(name: str) -> tuple[str, str]:
    prefix, _, suffix = name.rpartition(".")
    return prefix, suffix


def module_rule(cfg: Glm53Config, module: str) -> ModuleRule | None:
    """The split rule for a linear-like module prefix, or None when it is not a split module."""
    m = _LAYER.match(module)
    layer = int(m.group(1)) if m else 0
    if module in ("model.embed_tokens", "lm_head") or re.fullmatch(r"model\.layers\.\d+\.(embed_tokens|shared_head\.head)", module):
        return ModuleRule("vocab", "out", 1)
    if module.endswith(".self_attn.q_b_proj"):
        return ModuleRule("heads", "out", cfg.qk_head_dim)
    if module.endswith(".self_attn.kv_b_proj"):
        return ModuleRule("heads", "out", cfg.qk_nope_head_dim + cfg.v_head_dim)
    if module.endswith(".self_attn.o_proj"):
        return ModuleRule("heads", "in", cfg.v_head_dim)
    mlp = re.fullmatch(r"model\.layers\.\d+\.mlp\.(experts\.\d+\.|shared_experts\.)?(gate_proj|up_proj|down_proj)", module)
    if mlp:
        return ModuleRule("blocks", "in" if mlp.group(2) == "down_proj" else "out", BLOCK, layer)
    return None


def _axis_extent(info: TensorInfo, suffix: str, axis: Axis) -> int | None:
    """The module's feature count along `axis`, read from one of its stored tensors, if it shows it."""
    shape = info.shape
    if suffix == "weight" and len(shape) == 2:
        return shape[0] if axis == "out" else shape[1]
    if suffix == "trellis" and len(shape) == 3:
        return (shape[1] if axis == "out" else shape[0]) * TILE
    if suffix == "bias" and axis == "out" and len(shape) == 1:
        return shape[0]
    if suffix == ("svh" if axis == "out" else "suh") and len(shape) == 1:
        return shape[0]
    return None


def _tensor_slice(name: str, info: TensorInfo, suffix: str, split: FeatureSplit) -> SliceSpec | None:
    """The stored slice of tensor `name` that realises `split.read`; None for the whole tensor."""
    a, b = split.read
    if (a, b) == (0, split.total):
        return None
    out = split.axis == "out"
    if suffix == "weight":
        return SliceSpec(0 if out else 1, a, b)
    if suffix == "bias":
        return SliceSpec(0, a, b) if out else None
    if suffix in ("mcg", "mul1"):
        return None
    if suffix in ("suh", "svh"):
        return SliceSpec(0, a, b) if (suffix == "svh") == out else None
    if suffix in ("trellis", "su", "sv"):
        if a % TILE or (b % TILE and b != split.total):
            raise PlanError(f"{name}: range [{a}, {b}) is not on {TILE}-row EXL3 tile boundaries; this layout cannot split it")
        if suffix == "trellis":
            return SliceSpec(1 if out else 0, a // TILE, -(-b // TILE))
        return SliceSpec(0, a // TILE, -(-b // TILE)) if (suffix == "sv") == out else None
    raise PlanError(f"{name}: unknown part '.{suffix}' of a split module; the layout knows {', '.join(_LINEAR_SUFFIXES)}")


def _slice_bytes(info: TensorInfo, spec: SliceSpec | None) -> int:
    """Bytes of `spec` of tensor `info` (whole rows of its dim: the other dims' product stays)."""
    if spec is None:
        return info.nbytes
    rows = info.shape[spec.dim]
    return info.nbytes * (spec.stop - spec.start) // rows if rows else 0


@dataclass
class LayoutPlan:
    ranks: int
    config: Glm53Config
    tensors: dict[str, TensorInfo]
    locations: dict[str, TensorLocation] = field(default_factory=dict)
    rules: dict[str, ModuleRule] = field(default_factory=dict)  # module prefix -> rule (split modules only)
    extents: dict[str, int] = field(default_factory=dict)  # module prefix -> features along the split axis
    exl3_modules: set[str] = field(default_factory=set)
    unclassified: list[str] = field(default_factory=list)  # replicated because no rule names them
    members: dict[str, list[tuple[str, str]]] = field(default_factory=dict, repr=False)  # split module -> (name, part)
    _features: dict[int, dict[str, FeatureSplit]] = field(default_factory=dict, repr=False)
    _slices: dict[int, dict[str, SliceSpec | None]] = field(default_factory=dict, repr=False)
    _bytes: list[int] | None = field(default=None, repr=False)

    # ---- per rank ------------------------------------------------------------------------
    def features(self, rank: int) -> Mapping[str, FeatureSplit]:
        """Module prefix -> the features this rank owns and reads, for every split module."""
        self._check_rank(rank)
        if rank not in self._features:
            memo: dict[tuple, FeatureSplit] = {}  # 58k modules share a handful of (rule, width, exl3)
            out: dict[str, FeatureSplit] = {}
            for module, rule in self.rules.items():
                total = self.extents[module]
                rotate = rule.layer % self.ranks if rule.layer is not None else 0
                key = (rule.kind, rule.axis, rule.unit, rotate, total, module in self.exl3_modules)
                split = memo.get(key)
                if split is None:
                    own = self._own_range(rule, total, rank, module)
                    read = own
                    if key[-1] and own[0] < own[1]:
                        read = (own[0] // BLOCK * BLOCK, min(-(-own[1] // BLOCK) * BLOCK, total))
                    split = memo[key] = FeatureSplit(rule.axis or "out", own, read, total)
                out[module] = split
            self._features[rank] = out
        return MappingProxyType(self._features[rank])

    def slices(self, rank: int) -> Mapping[str, SliceSpec | None]:
        """Every tensor -> the slice rank `rank` holds (None: the whole tensor, replicated). Read-only."""
        return MappingProxyType(self._slices_of(rank))

    def _slices_of(self, rank: int) -> dict[str, SliceSpec | None]:
        if rank in self._slices:
            return self._slices[rank]
        feats = self.features(rank)
        result: dict[str, SliceSpec | None] = dict.fromkeys(self.tensors)  # replicated unless a split module says
        memo: dict[tuple, SliceSpec | None] = {}  # thousands of experts share a few (part, shape, split)
        tensors = self.tensors
        for module, parts in self.members.items():
            split = feats[module]
            skey = (split.axis, split.read, split.total)
            for name, suffix in parts:
                info = tensors[name]
                key = (suffix, info.shape, skey)
                spec = memo.get(key, memo)
                if spec is memo:
                    spec = memo[key] = _tensor_slice(name, info, suffix, split)
                result[name] = spec
        self._slices[rank] = result
        return result

    def bytes_per_rank(self) -> list[int]:
        """Weight bytes each rank holds (from the headers; replicated tensors counted on every rank)."""
        if self._bytes is None:
            tensors = self.tensors
            split_names = [n for parts in self.members.values() for n, _ in parts]
            replicated = self.total_bytes - sum(tensors[n].nbytes for n in split_names)
            totals = []
            for r in range(self.ranks):
                slices = self._slices_of(r)
                total = replicated
                memo: dict[tuple, int] = {}
                for name in split_names:
                    info, spec = tensors[name], slices[name]
                    key = (info.nbytes, info.shape, spec)
                    got = memo.get(key)
                    if got is None:
                        got = memo[key] = _slice_bytes(info, spec)
                    total += got
                totals.append(total)
            self._bytes = totals
        return list(self._bytes)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def rule_of(self, name: str) -> str:
        module, _ = _module_and_suffix(name)
        rule = self.rules.get(module)
        return "replicated" if rule is None else f"{rule.kind}:{rule.axis}"

    def summary(self) -> dict[str, object]:
        counts: dict[str, int] = {}
        bytes_by_rule: dict[str, int] = {}
        for name, info in self.tensors.items():
            rule = self.rule_of(name)
            counts[rule] = counts.get(rule, 0) + 1
            bytes_by_rule[rule] = bytes_by_rule.get(rule, 0) + info.nbytes
        heads = split_units(self.config.num_attention_heads, self.ranks)
        return {
            "ranks": self.ranks,
            "total_bytes": self.total_bytes,
            "bytes_per_rank": self.bytes_per_rank(),
            "heads_per_rank": [b - a for a, b in heads],
            "expert_blocks_per_rank_by_layer_mod_ranks": [
                [b - a for a, b in split_units(self.config.moe_intermediate_size // BLOCK, self.ranks, k)] for k in range(self.ranks)
            ],
            "tensors_by_rule": counts,
            "bytes_by_rule": bytes_by_rule,
            "widened_exl3_modules": sorted(
                {m for r in range(self.ranks) for m, f in self.features(r).items() if f.read != f.own}
            ),
            "unclassified": list(self.unclassified),
        }

    # ---- internals -----------------------------------------------------------------------
    def _own_range(self, rule: ModuleRule, total: int, rank: int, module: str) -> tuple[int, int]:
        if rule.kind == "vocab":
            a, b = split_units(total, self.ranks)[rank]
            return a, b
        n_units, rem = divmod(total, rule.unit)
        if rem:
            raise PlanError(f"{module}: {total} features along its {rule.axis} axis is not a multiple of {rule.unit} ({rule.kind})")
        rotate = rule.layer % self.ranks if rule.layer is not None else 0
        a, b = split_units(n_units, self.ranks, rotate)[rank]
        return a * rule.unit, b * rule.unit

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.ranks:
            raise PlanError(f"rank {rank} is outside 0..{self.ranks - 1}")


@dataclass
class _Classification:
    """The rank-independent part of a plan: which modules split how (shared by plans for several R)."""
    rules: dict[str, ModuleRule]
    extents: dict[str, int]
    exl3_modules: set[str]
    unclassified: list[str]
    members: dict[str, list[tuple[str, str]]]


def _classify(tensors: Mapping[str, TensorInfo], config: Glm53Config) -> _Classification:
    c = _Classification({}, {}, set(), [], {})
    rule_cache: dict[str, ModuleRule | None] = {}
    for name, info in tensors.items():
        module, suffix = _module_and_suffix(name)
        if module not in rule_cache:
            rule_cache[module] = module_rule(config, module)
        rule = rule_cache[module]
        if rule is None:
            if not _REPLICATED.match(name):
                c.unclassified.append(name)
            continue
        if suffix not in _LINEAR_SUFFIXES:
            raise PlanError(f"{name}: unknown part '.{suffix}' of a split module; the layout knows {', '.join(_LINEAR_SUFFIXES)}")
        c.rules[module] = rule
        c.members.setdefault(module, []).append((name, suffix))
        if suffix == "trellis":
            c.exl3_modules.add(module)
        extent = _axis_extent(info, suffix, rule.axis or "out")
        if extent is not None:
            seen = c.extents.setdefault(module, extent)
            if seen != extent:
                raise PlanError(f"{name}: shape {list(info.shape)} gives {extent} {rule.axis} features, its module's other tensors {seen}")
    for module in c.rules:
        if module not in c.extents:
            raise PlanError(f"{module}: none of its tensors shows its {c.rules[module].axis} width (need .weight, .trellis or the sign vector)")
    return c


def plan_layouts(
    source: str | Path | Mapping[str, TensorInfo],
    ranks: Iterable[int],
    config: Glm53Config | None = None,
) -> dict[int, LayoutPlan]:
    """Plans for several rank counts at once (the headers are read and classified once)."""
    wanted = list(ranks)
    for r in wanted:
        if not 1 <= r <= MAX_RANKS:
            raise PlanError(f"ranks = {r}: the layout supports 1..{MAX_RANKS} ranks")
    locations: dict[str, TensorLocation] = {}
    if isinstance(source, (str, Path)):
        config = config or Glm53Config.from_dir(source)
        tensors, locations = read_tensor_table(source)
    else:
        if config is None:
            raise PlanError("plan_layout: pass the config when planning from a header table")
        tensors = dict(source)
    for r in wanted:
        if config.num_attention_heads < r:
            raise PlanError(f"ranks = {r} exceeds the {config.num_attention_heads} attention heads; use at most that many ranks")
    c = _classify(tensors, config)
    plans = {}
    for r in wanted:
        plan = LayoutPlan(r, config, tensors, locations, c.rules, c.extents, c.exl3_modules, list(c.unclassified), c.members)
        for rank in range(r):
            plan._slices_of(rank)  # validates divisibility and tile alignment up front
        plans[r] = plan
    return plans


def plan_layout(
    source: str | Path | Mapping[str, TensorInfo],
    ranks: int,
    config: Glm53Config | None = None,
) -> LayoutPlan:
    """Build the plan for `ranks` ranks from a checkpoint folder, or from a name -> TensorInfo table
    (then `config` is required). Reads headers only."""
    return plan_layouts(source, [ranks], config)[ranks]


def read_tensor_table(model_dir: str | Path) -> tuple[dict[str, TensorInfo], dict[str, TensorLocation]]:
    """Every tensor's header entry and location, from the index (or the lone model.safetensors).
    Raises ShardError for a damaged shard: run `python -m glm53.checkpoints verify` for the full report."""
    root = Path(model_dir)
    index_path = root / INDEX_NAME
    if index_path.exists():
        weight_map = json.loads(index_path.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = [p.name for p in sorted(root.glob("*.safetensors"))]
        if not files:
            raise PlanError(f"{root}: no {INDEX_NAME} and no *.safetensors; is this a checkpoint folder?")
    tensors: dict[str, TensorInfo] = {}
    locations: dict[str, TensorLocation] = {}
    for fname in files:
        header = read_header(root / fname)
        for name, info in header.tensors.items():
            tensors[name] = info
            locations[name] = TensorLocation(str((root / fname).resolve()), header.data_offset)
    return tensors, locations
