"""Which tensors a servable GLM-5.3 checkpoint holds, judged from safetensors headers alone
(names, dtypes, shapes; no tensor data is read).

One rule for every judge: `glm53.check()` (weights_loader.check_checkpoint) raises the first
problem, `fetch_weights.sh` (glm53/checkpoints/verify.py) reports them all as model-level findings
(exit 3), and the loader serves what the rule accepts.

Linears. A linear P whose config gives (in_f, out_f) is stored either plain, `P.weight`
[out_f, in_f] in bf16/fp16/fp32, or, where the rule lets it, as an EXL3 group
(glm53/exl3/format.py, glm53/formats/exl3_storage.py):

    P.trellis         int16 [pad(in_f)/16, pad(out_f)/16, 16*K], K in SERVED_BITS (glm53/formats/exl3_storage.py)
    P.suh | P.su      fp16 [pad(in_f)] | packed int16 [pad(in_f)/16]
    P.svh | P.sv      fp16 [pad(out_f)] | packed int16 [pad(out_f)/16]
    P.mcg | P.mul1    at most one, an int32 scalar (shape []); half-integer K needs mul1

pad(n) is n rounded up to a multiple of 128: exllamav3 1.6.5 builds every such Linear with
pad_to=128 (modules/linear.py: in_features/out_features padded, the unpadded ones kept), zero-extends
a narrower input and trims the padded outputs. MTP's eh_proj is built with pad_to=1 there, so it can
be EXL3 only when its features already are multiples of 128. No GLM-5.3 linear has a bias. Parts
the rule does not know under a linear's prefix, and `.weight` beside EXL3 parts, are refused.

Which linears may be EXL3 is what exllamav3 1.6.5 quantizes for glm_moe_dsa (a Linear built with a
qmap: architecture/glm_moe_dsa.py, glm_moe_dsa_mtp.py, modules/mla_attn.py, block_sparse_mlp.py):
q_a_proj, q_b_proj, kv_a_proj_with_mqa, o_proj, the indexer's wq_b, the dense MLP, the shared and
the routed experts, and MTP's eh_proj. exllamav3 keeps kv_b_proj in fp16 (its attention absorbs
kv_b into the query and output); the rule still lets kv_b_proj be EXL3, as the kit's synthetic pack
stores it (glm53/synthetic/checkpoints.py), since the kit decodes it like any other linear. Plain only:
the router (mlp.gate), the indexer's wk and weights_proj (exllamav3 builds them with qmap None),
the embeddings and lm_head (exllamav3 quantizes lm_head unless converted with --head_bits 16; the
kit serves a 16-bit head).

The MTP layer (stored as layer num_hidden_layers) is served when its eh_proj is there (exllamav3
decides the same way; converted packs often leave it out); it then follows the same rules.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Union

from glm53.config import Glm53Config
from glm53.formats.exl3_storage import HADAMARD_BLOCK, KNOWN_PARTS, SERVED_BITS
from glm53.formats.safetensors_header import ShardError, ShardHeader, read_header

PLAIN_DTYPES = ("BF16", "F16", "F32")
EXL3_PAD = 128  # exllamav3's pad_to for an EXL3 linear's in and out features
MARKERS = ("mcg", "mul1")
SIGN_VECTORS = (("suh", "su", "in"), ("svh", "sv", "out"))  # (fp16 part, packed part, side)
LINEAR_PARTS = ("weight",) + KNOWN_PARTS  # every part a linear may hold (bias: known, and refused)
EXL3_PARTS = tuple(p for p in KNOWN_PARTS if p != "bias")
MISMATCH = "the checkpoint does not match its config.json (wrong or partial pack?); fetch the pack made for it"
REQUANTIZE = "re-export this linear with exllamav3 at a width the kit serves"


@dataclass(frozen=True)
class TensorMeta:
    """A tensor as its shard's header describes it. dtype/shape None: the header could not be
    read or lacks the tensor (a file problem, reported by the file checks), so it is not judged."""
    file: str
    dtype: str | None = None
    shape: tuple[int, ...] | None = None


@dataclass(frozen=True)
class TensorRule:
    """A tensor that is not a linear (norms, embeddings, the router's score bias)."""
    name: str
    shape: tuple[int, ...]
    required: bool = True


@dataclass(frozen=True)
class LinearRule:
    """A linear module: plain, or EXL3 where `exl3` is True (`plain_why` says why not)."""
    prefix: str
    in_f: int
    out_f: int
    exl3: bool = True
    pad_to: int = EXL3_PAD
    plain_why: str = ""
    required: bool = True

    def padded(self) -> tuple[int, int]:
        return pad_features(self.in_f, self.pad_to), pad_features(self.out_f, self.pad_to)


Rule = Union[TensorRule, LinearRule]


@dataclass(frozen=True)
class Problem:
    layer: int | None
    kind: str  # missing | shape | dtype | width | exl3_placement | bias | unknown_part | ambiguous
    tensor: str
    file: str
    detail: str
    remedy: str = MISMATCH

    def text(self) -> str:
        return f"{self.file}: {self.detail}; {self.remedy}"


def pad_features(n: int, to: int = EXL3_PAD) -> int:
    """An EXL3 linear's stored features: n rounded up to a multiple of `to` (exllamav3's pad_to)."""
    return -(-n // to) * to


# ---- what the config implies ------------------------------------------------------------------

_ROUTER_WHY = "the router stays 16-bit (exllamav3 keeps it unquantized; the kit scores experts in fp32)"
_INDEXER_WHY = "the indexer's wk and weights_proj stay 16-bit (exllamav3 keeps them unquantized)"
_HEAD_WHY = ("the kit serves a 16-bit head (exllamav3 quantizes lm_head unless converted with "
             "--head_bits 16)")


def mtp_layers(cfg: Glm53Config, names: Iterable[str]) -> list[int]:
    """The MTP layers the checkpoint holds: those of the config's whose eh_proj is stored."""
    names = names if isinstance(names, (set, frozenset, dict)) else set(names)
    first = cfg.num_hidden_layers
    return [i for i in range(first, first + cfg.num_mtp_layers)
            if f"model.layers.{i}.eh_proj.weight" in names or f"model.layers.{i}.eh_proj.trellis" in names]


def _mlp(p: str, hidden: int, width: int) -> list[Rule]:
    return [LinearRule(f"{p}.gate_proj", hidden, width), LinearRule(f"{p}.up_proj", hidden, width),
            LinearRule(f"{p}.down_proj", width, hidden)]


def layer_rules(cfg: Glm53Config, i: int) -> list[Rule]:
    """Every tensor of decoder layer `i` (or of the MTP layer stored as `i`), in checkpoint order."""
    c, p = cfg, f"model.layers.{i}"
    a, h = f"{p}.self_attn", c.hidden_size
    mtp = i >= c.num_hidden_layers
    heads = c.num_attention_heads
    rules: list[Rule] = []
    if mtp:
        rules += [TensorRule(f"{p}.embed_tokens.weight", (c.vocab_size, h), required=False),
                  TensorRule(f"{p}.enorm.weight", (h,)), TensorRule(f"{p}.hnorm.weight", (h,)),
                  LinearRule(f"{p}.eh_proj", 2 * h, h, pad_to=1)]  # exllamav3: pad_to=1, qbits mtp_bits
    rules += [
        TensorRule(f"{p}.input_layernorm.weight", (h,)), TensorRule(f"{p}.post_attention_layernorm.weight", (h,)),
        LinearRule(f"{a}.q_a_proj", h, c.q_lora_rank), TensorRule(f"{a}.q_a_layernorm.weight", (c.q_lora_rank,)),
        LinearRule(f"{a}.q_b_proj", c.q_lora_rank, heads * c.qk_head_dim),
        LinearRule(f"{a}.kv_a_proj_with_mqa", h, c.kv_lora_rank + c.qk_rope_head_dim),
        TensorRule(f"{a}.kv_a_layernorm.weight", (c.kv_lora_rank,)),
        LinearRule(f"{a}.kv_b_proj", c.kv_lora_rank, heads * (c.qk_nope_head_dim + c.v_head_dim)),
        LinearRule(f"{a}.o_proj", heads * c.v_head_dim, h),
    ]
    if mtp or c.indexer_is_full(i):  # exllamav3's MTP layer has its own (full) indexer
        x = f"{a}.indexer"
        rules += [LinearRule(f"{x}.wq_b", c.q_lora_rank, c.index_n_heads * c.index_head_dim),
                  LinearRule(f"{x}.wk", h, c.index_head_dim, exl3=False, plain_why=_INDEXER_WHY),
                  TensorRule(f"{x}.k_norm.weight", (c.index_head_dim,)),
                  TensorRule(f"{x}.k_norm.bias", (c.index_head_dim,)),
                  LinearRule(f"{x}.weights_proj", h, c.index_n_heads, exl3=False, plain_why=_INDEXER_WHY)]
    m = f"{p}.mlp"
    if not mtp and not c.is_moe_layer(i):
        return rules + _mlp(m, h, c.intermediate_size)
    rules += [LinearRule(f"{m}.gate", h, c.n_routed_experts, exl3=False, plain_why=_ROUTER_WHY),
              TensorRule(f"{m}.gate.e_score_correction_bias", (c.n_routed_experts,))]
    if c.n_shared_experts:
        rules += _mlp(f"{m}.shared_experts", h, c.moe_intermediate_size * c.n_shared_experts)
    for e in range(c.n_routed_experts):
        rules += _mlp(f"{m}.experts.{e}", h, c.moe_intermediate_size)
    if mtp:
        rules += [TensorRule(f"{p}.shared_head.norm.weight", (h,)),
                  LinearRule(f"{p}.shared_head.head", h, c.vocab_size, exl3=False, plain_why=_HEAD_WHY, required=False)]
    return rules


def top_rules(cfg: Glm53Config) -> list[Rule]:
    rules: list[Rule] = [TensorRule("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size)),
                         TensorRule("model.norm.weight", (cfg.hidden_size,))]
    if not cfg.tie_word_embeddings:
        rules.append(LinearRule("lm_head", cfg.hidden_size, cfg.vocab_size, exl3=False, plain_why=_HEAD_WHY))
    return rules


def model_rules(cfg: Glm53Config, names: Iterable[str]) -> Iterator[tuple[int | None, list[Rule]]]:
    """(layer or None for the top level, its rules): decoder layers, then the MTP layers present."""
    yield None, top_rules(cfg)
    for i in [*range(cfg.num_hidden_layers), *mtp_layers(cfg, names)]:
        yield i, layer_rules(cfg, i)


def linear_dims(cfg: Glm53Config, names: Iterable[str]) -> dict[str, LinearRule]:
    """prefix -> LinearRule for every linear the checkpoint must (or may) hold."""
    return {r.prefix: r for _, rules in model_rules(cfg, names) for r in rules if isinstance(r, LinearRule)}


# ---- judging a header table -------------------------------------------------------------------

def tensor_table(where: Mapping[str, str | Path], headers: Mapping[str, ShardHeader]) -> dict[str, TensorMeta]:
    """name -> TensorMeta for every name mapped to a shard path (`where`), from the shards' headers
    (`headers`, by shard path). A shard without a header, or a header without the name, gives a
    meta with no dtype/shape: the file checks report those."""
    table = {}
    for name, shard in where.items():
        info = headers[str(shard)].tensors.get(name) if str(shard) in headers else None
        table[name] = TensorMeta(str(shard), info.dtype, tuple(info.shape)) if info else TensorMeta(str(shard))
    return table


def check_tensors(cfg: Glm53Config, tensors: Mapping[str, TensorMeta], folder: str | Path) -> list[Problem]:
    """Every problem, in checkpoint order; [] when the checkpoint is servable. `folder` is named in
    problems about tensors that are absent (no shard to name)."""
    by_prefix: dict[str, dict[str, TensorMeta]] = {}
    for name, meta in tensors.items():
        prefix, _, part = name.rpartition(".")
        by_prefix.setdefault(prefix, {})[part] = meta
    problems: list[Problem] = []
    for layer, rules in model_rules(cfg, tensors):
        context = _layer_context(cfg, layer)
        plain_names = {r.name for r in rules if isinstance(r, TensorRule)}
        for rule in rules:
            if isinstance(rule, TensorRule):
                problems += _tensor_problems(rule, tensors.get(rule.name), layer, str(folder), context)
            else:
                parts = {part: meta for part, meta in by_prefix.get(rule.prefix, {}).items()
                         if f"{rule.prefix}.{part}" not in plain_names}
                problems += _linear_problems(rule, parts, layer, str(folder), context)
    return problems


def first_refusal(cfg: Glm53Config, where: Mapping[str, Path], folder: str | Path) -> str | None:
    """Why the checkpoint (`where`: its index's name -> shard path) cannot be served, naming the file
    and tensor; None when it can. Reads each shard's header, nothing else."""
    try:
        headers = {str(shard): read_header(shard) for shard in sorted(set(where.values()))}
    except ShardError as exc:
        return str(exc)
    table = tensor_table(where, headers)
    absent = next((name for name, meta in table.items() if meta.shape is None), None)
    if absent is not None:
        return (f"{where[absent]}: lacks tensor {absent}, which the index maps to it; the index and the "
                "shard disagree: re-download both (bash fetch_weights.sh)")
    problems = check_tensors(cfg, table, folder)
    return problems[0].text() if problems else None


def _layer_context(cfg: Glm53Config, layer: int | None) -> str:
    if layer is None:
        return ""
    if layer >= cfg.num_hidden_layers:
        return f" (config.json: layer {layer} is the MTP layer, whose eh_proj is stored)"
    kind = "MoE" if cfg.is_moe_layer(layer) else "dense"
    return f" (config.json says layer {layer} is {kind}, indexer {'full' if cfg.indexer_is_full(layer) else 'shared'})"


def _tensor_problems(rule: TensorRule, meta: TensorMeta | None, layer: int | None, folder: str,
                     context: str) -> list[Problem]:
    if meta is None:
        if not rule.required:
            return []
        return [Problem(layer, "missing", rule.name, folder, f"tensor {rule.name} is missing{context}")]
    return _plain_problems(rule.name, meta, rule.shape, layer)


def _plain_problems(name: str, meta: TensorMeta, shape: tuple[int, ...], layer: int | None) -> list[Problem]:
    if meta.shape is None:
        return []
    if meta.dtype not in PLAIN_DTYPES:
        return [Problem(layer, "dtype", name, meta.file, f"{name} is {meta.dtype}; the kit serves it in "
                        f"{'/'.join(PLAIN_DTYPES)}")]
    if meta.shape != shape:
        return [Problem(layer, "shape", name, meta.file,
                        f"{name} has shape {list(meta.shape)}; config.json implies {list(shape)}")]
    return []


def _linear_problems(rule: LinearRule, parts: dict[str, TensorMeta], layer: int | None, folder: str,
                     context: str) -> list[Problem]:
    p = rule.prefix
    structural = _structure_problems(rule, parts, layer)
    if structural:
        return structural
    if "weight" in parts:
        return _plain_problems(f"{p}.weight", parts["weight"], (rule.out_f, rule.in_f), layer)
    if not parts:
        if not rule.required:
            return []
        also = f" (nor EXL3 {p}.trellis)" if rule.exl3 else ""
        return [Problem(layer, "missing", f"{p}.weight", folder, f"tensor {p}.weight is missing{also}{context}")]
    first = next(iter(parts.values())).file
    if not rule.exl3:
        part = "trellis" if "trellis" in parts else next(iter(parts))
        return [Problem(layer, "exl3_placement", f"{p}.{part}", parts[part].file,
                        f"{p}.{part}: {p} is stored as EXL3, but it must be a plain {p}.weight "
                        f"[{rule.out_f}, {rule.in_f}]: {rule.plain_why}",
                        f"re-export the pack with {p} unquantized (bf16/fp16)")]
    if "trellis" not in parts:
        return [Problem(layer, "missing", f"{p}.trellis", first,
                        f"EXL3 group {p} has {', '.join(sorted(parts))} but no {p}.trellis{context}")]
    return _exl3_problems(rule, parts, layer)


def _structure_problems(rule: LinearRule, parts: dict[str, TensorMeta], layer: int | None) -> list[Problem]:
    """Refusals that do not depend on shapes: a bias, an unknown part, .weight beside EXL3 parts."""
    p, out = rule.prefix, []
    for part, meta in parts.items():
        name = f"{p}.{part}"
        if part == "bias":
            out.append(Problem(layer, "bias", name, meta.file, f"{name}: GLM-5.3's linears have no bias, "
                               f"so this is not a GLM-5.3 pack (or was exported wrongly)",
                               "fetch a GLM-5.3 (glm_moe_dsa) pack; a bias would be silently dropped, so it is refused"))
        elif part not in LINEAR_PARTS:
            out.append(Problem(layer, "unknown_part", name, meta.file,
                               f"{name}: unknown part '{part}' of linear {p} (a new codebook marker, scale or "
                               f"format?); known parts are {', '.join(LINEAR_PARTS)}",
                               "serve it with a kit that knows this part, or re-export the pack"))
    exl3 = [part for part in EXL3_PARTS if part in parts]
    if "weight" in parts and exl3:
        both = "trellis" if "trellis" in exl3 else exl3[0]
        out.append(Problem(layer, "ambiguous", f"{p}.{both}", parts[both].file,
                           f"{p} has both a plain {p}.weight ({parts['weight'].file}) and EXL3 {p}.{both}: "
                           f"which one to serve is ambiguous",
                           "remove one of the two (re-download the pack: one export stores one form)"))
    return out


def _exl3_problems(rule: LinearRule, parts: dict[str, TensorMeta], layer: int | None) -> list[Problem]:
    p = rule.prefix
    trellis = parts["trellis"]
    name = f"{p}.trellis"
    pin, pout = rule.padded()
    if pin % HADAMARD_BLOCK or pout % HADAMARD_BLOCK:
        return [Problem(layer, "exl3_placement", name, trellis.file,
                        f"{name}: {p} has [{rule.in_f}, {rule.out_f}] features, which exllamav3 does not pad "
                        f"for this module, so it cannot be EXL3 (Hadamard block {HADAMARD_BLOCK})",
                        f"re-export the pack with {p} unquantized")]
    problems: list[Problem] = []
    if trellis.shape is not None:
        problems += _trellis_problems(rule, trellis, "mul1" in parts, layer)
    sides = {"in": pin, "out": pout}
    for fp16, packed, side in SIGN_VECTORS:
        n = sides[side]
        present = [part for part in (fp16, packed) if part in parts]
        if not present:
            problems.append(Problem(layer, "missing", f"{p}.{fp16}", trellis.file,
                                    f"EXL3 group {p} lacks its {side}put sign vector: neither {p}.{fp16} "
                                    f"(fp16 [{n}]) nor packed {p}.{packed} (int16 [{n // 16}]) is stored"))
        for part in present:
            dtype, shape = ("F16", (n,)) if part == fp16 else ("I16", (n // 16,))
            problems += _exact(f"{p}.{part}", parts[part], dtype, shape, layer, _pad_note(rule))
    markers = [m for m in MARKERS if m in parts]
    if len(markers) > 1:
        problems.append(Problem(layer, "ambiguous", f"{p}.mcg", parts["mcg"].file,
                                f"EXL3 group {p} has both {p}.mcg and {p}.mul1; a group has one codebook",
                                "re-download the pack (one export writes one marker)"))
    for m in markers:
        problems += _exact(f"{p}.{m}", parts[m], "I32", (), layer, " (a codebook marker: one int32 scalar)")
    return problems


def _trellis_problems(rule: LinearRule, meta: TensorMeta, has_mul1: bool, layer: int | None) -> list[Problem]:
    p, name = rule.prefix, f"{rule.prefix}.trellis"
    pin, pout = rule.padded()
    shape = meta.shape or ()
    want = f"[{pin // 16}, {pout // 16}, 16*K] for K in {', '.join(f'{k:g}' for k in SERVED_BITS)}"
    if meta.dtype != "I16":
        return [Problem(layer, "dtype", name, meta.file, f"{name} is {meta.dtype}; EXL3 trellises are I16 {want}")]
    if len(shape) != 3 or shape[:2] != (pin // 16, pout // 16):
        return [Problem(layer, "shape", name, meta.file,
                        f"{name} has shape {list(shape)}; config.json implies {want}{_pad_note(rule)}")]
    bits = shape[2] / 16
    if bits not in SERVED_BITS:
        return [Problem(layer, "width", name, meta.file,
                        f"{name} has K = {bits:g} bits (last dimension {shape[2]}); the kit serves K in "
                        f"{', '.join(f'{k:g}' for k in SERVED_BITS)}", REQUANTIZE)]
    if not bits.is_integer() and not has_mul1:
        return [Problem(layer, "width", name, meta.file,
                        f"{name} has half-integer K = {bits:g}, which needs the mul1 codebook, but {p}.mul1 is "
                        "not stored", REQUANTIZE)]
    return []


def _exact(name: str, meta: TensorMeta, dtype: str, shape: tuple[int, ...], layer: int | None,
           note: str) -> list[Problem]:
    if meta.shape is None or (meta.dtype, meta.shape) == (dtype, shape):
        return []
    kind = "dtype" if meta.dtype != dtype else "shape"
    return [Problem(layer, kind, name, meta.file,
                    f"{name} is {meta.dtype} {list(meta.shape)}; expected {dtype} {list(shape)}{note}")]


def _pad_note(rule: LinearRule) -> str:
    pin, pout = rule.padded()
    if (pin, pout) == (rule.in_f, rule.out_f):
        return ""
    return (f" (config.json gives [{rule.in_f} in, {rule.out_f} out]; EXL3 pads both to multiples of "
            f"{rule.pad_to}: [{pin}, {pout}])")
