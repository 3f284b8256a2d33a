"""Model configurations: one dataclass of every knob, and the named sizes of the paper's Table app_model.

The attention kind is picked by name (`attention`, a key of `piattn.layers.ATTENTION`, checked when a
model is built); each kind reads the fields it needs, so a model never changes to gain a new kind.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from ..analysis.multiscale import SCHEDULES, periods_per_layer, schedule
from ..checks import is_int
from .pi import PI_DEFAULTS, PiSettings

# Table app_model (Small / Medium / Large, head dim 64, vocab 50,257) plus `tiny`, sized for a CPU.
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(n_layer=4, n_head=4, d_model=128, d_ff=512),
    "small": dict(n_layer=12, n_head=12, d_model=768, d_ff=3072),
    "medium": dict(n_layer=24, n_head=16, d_model=1024, d_ff=4096),
    "large": dict(n_layer=32, n_head=20, d_model=1280, d_ff=5120),
}


def check_kv_heads(n_heads: int, n_kv_heads: int, name: str = "n_kv_heads") -> None:
    """ValueError unless n_kv_heads is a positive int dividing n_heads (grouped-query attention)."""
    if not is_int(n_kv_heads) or n_kv_heads < 1 or n_heads % n_kv_heads:
        raise ValueError(f"{name} must be a positive integer dividing the {n_heads} query heads, got {n_kv_heads!r}")


@dataclass
class ModelConfig:
    """Fields shared by the causal LM and the encoder classifier.

    Sizes: n_layer, n_head, d_model (head dim d_model / n_head), d_ff (FFN width, default 4·d_model),
    block_size (longest sequence), vocab_size; n_kv_head: key/value heads (grouped-query attention, dividing
    n_head; None: n_head, plain multi-head; `dense`, `local` and `pi` accept fewer).
    Attention: `attention` names the kind; window, period, variant, prior, logit_clamp, gate_eps are the
    π-Attention knobs (`PiSettings`; period: one int, per head, per layer and head, or a schedule, see
    `resolve_periods`, stored resolved so that a checkpoint's config rebuilds the same periods; with
    sinks: the first `sinks` keys of each document seen by all its
    later queries, for `pi`; window is also the radius of local and longformer; bigbird slides over
    ceil(window / sparse_block) blocks each side); n_global global tokens (longformer) or global blocks of
    sparse_block tokens (bigbird); sparse_block and n_random (bigbird's block size and random blocks per
    query block); n_hashes and bucket_size (reformer's LSH rounds and bucket width); backend (π operator backend).
    Images: image_width, the width of raster-scanned images in the sequence (set by image tasks from the data;
    None: the sequence is no image; the period words of `geometry_periods`, "width", "neighbourhood", …,
    resolve from it); radius (neighbourhood: rows and columns each side) and stride (strided: the Sparse
    Transformer's l, None: image_width).
    Training: dropout (residual, attention and FFN, 0.1 in the paper), init_std (0.02), rope_base.
    Hybrid stacks: layers, a pattern of kinds repeated over depth ("pi*3,dense": three π layers, then a
    dense one; `parse_layers`), None: every layer `attention`; `layer_kinds()` gives one kind per layer.
    Every layer takes the shared settings of its kind (window, sinks, its periods). nope_global: no RoPE on the
    dense (global) layers (NoPE, as Llama 4 and Command A); a `period` schedule "cover" is designed for the π
    layers only (a dense layer reaches every lag by itself).
    """

    n_layer: int = 12
    n_head: int = 12
    n_kv_head: int | None = None
    d_model: int = 768
    d_ff: int | None = None
    block_size: int = 1024
    vocab_size: int = 50257
    attention: str = "pi"
    window: int = PI_DEFAULTS.window
    period: int | str | list = PI_DEFAULTS.period
    variant: str = PI_DEFAULTS.variant
    prior: float = PI_DEFAULTS.prior
    logit_clamp: float | None = PI_DEFAULTS.logit_clamp
    gate_eps: float = PI_DEFAULTS.eps
    sinks: int = PI_DEFAULTS.sinks
    n_global: int = 1
    sparse_block: int = 16
    n_random: int = 2
    n_hashes: int = 2
    bucket_size: int = 32
    image_width: int | None = None
    radius: int = 1
    stride: int | None = None
    backend: str = "auto"
    dropout: float = 0.1
    init_std: float = 0.02
    rope_base: float = 10000.0
    layers: str | None = None
    nope_global: bool = False

    def __post_init__(self):
        for name in ("n_layer", "n_head", "d_model", "block_size", "vocab_size"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if self.n_kv_head is not None:
            check_kv_heads(self.n_head, self.n_kv_head, name="n_kv_head")
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model
        if not is_int(self.d_ff) or self.d_ff < 1:
            raise ValueError(f"d_ff must be a positive integer, got {self.d_ff!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        for name, low in (("image_width", 1), ("radius", 0), ("stride", 1)):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < low):
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.radius is None:
            raise ValueError("radius must be an integer >= 0, got None")
        if not isinstance(self.nope_global, bool):
            raise ValueError(f"nope_global must be a bool, got {self.nope_global!r}")
        kinds = self.layer_kinds()  # checks the pattern against n_layer
        if is_geometry_period(self.period):
            self.period = geometry_periods(self.period, self.image_width, self.n_head)
        pi_layers = None if self.layers is None else [i for i, kind in enumerate(kinds) if kind == PI_KIND]
        self.period = resolve_periods(self.period, window=self.window, n_layer=self.n_layer, n_head=self.n_head,
                                      block_size=self.block_size, pi_layers=pi_layers)
        # Every layer's operator settings, built (and so checked) once, here: a π layer is handed its own object
        # (`pi_settings`).
        self._pi_layers = layer_settings(periods_per_layer(self.period, self.n_layer, self.n_head),
                                         window=self.window, variant=self.variant, prior=self.prior,
                                         logit_clamp=self.logit_clamp, eps=self.gate_eps, sinks=self.sinks)

    def layer_kinds(self) -> tuple[str, ...]:
        """The attention kind of each of the n_layer layers: `layers` expanded (`parse_layers`), or `attention`
        everywhere. The kinds' names are checked when the model is built (the registry sits above the config)."""
        if self.layers is None:
            return (self.attention,) * self.n_layer
        return parse_layers(self.layers, self.n_layer)

    def is_hybrid(self) -> bool:
        """Whether the layers are of more than one kind."""
        return len(set(self.layer_kinds())) > 1

    def rotary_at(self, layer: int) -> bool:
        """Whether layer `layer` rotates q and k by RoPE: every layer but the dense ones under `nope_global`."""
        return not (self.nope_global and self.layer_kinds()[layer] == GLOBAL_KIND)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_head, or n_head when it is None."""
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def pi(self) -> PiSettings:
        """The π-Attention operator settings of layer 0 (layers differ in their periods only)."""
        return self.pi_settings(0)

    def pi_settings(self, layer: int) -> PiSettings:
        """The π-Attention operator settings of layer `layer`: the one `PiSettings` built and checked when the
        config was made (from window, variant, prior, logit_clamp, gate_eps, sinks and that layer's n_head
        periods, `periods_per_layer` reading every stored form), which a π layer takes whole
        (`PiAttention.config_kwargs`). Its period is an int, or a tuple of n_head per-head periods. A config is
        not changed once made: another is made (`dataclasses.replace`, `from_dict`), with its own settings."""
        return self._pi_layers[layer]

    @classmethod
    def from_name(cls, name: str, **overrides):
        """The named size (`tiny`, `small`, `medium`, `large`) with any field overridden by keyword."""
        if name not in SIZES:
            raise ValueError(f"config name must be one of {sorted(SIZES)}, got {name!r}")
        return cls.from_dict({**SIZES[name], **overrides})

    @classmethod
    def from_dict(cls, fields: dict):
        """The config of a field dict (a checkpoint's), ValueError naming any key that is not a field."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(fields) - known
        if unknown:
            raise ValueError(f"unknown {cls.__name__} fields {sorted(unknown)}; fields are {sorted(known)}")
        return cls(**fields)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def layer_settings(periods, *, window, variant, prior, logit_clamp, eps, sinks) -> tuple[PiSettings, ...]:
    """One `PiSettings` per layer, built (and so checked: ValueError naming the setting) once: `periods` holds
    each layer's per-head periods (`periods_per_layer`), the other settings are shared. Layers of equal periods
    share one object. What a model config (`ModelConfig.pi_settings`) and a converted Hugging Face model
    (`piattn.integrations.hf.HFPiSettings`) hand their layers."""
    made = {tuple(periods[0]): PiSettings(window=window, period=periods[0], variant=variant, prior=prior,
                                          logit_clamp=logit_clamp, eps=eps, sinks=sinks)}
    for heads in periods:
        if tuple(heads) not in made:
            made[tuple(heads)] = dataclasses.replace(made[tuple(periods[0])], period=heads)
    return tuple(made[tuple(heads)] for heads in periods)


# The kind whose periods `resolve_periods` designs in a hybrid stack, and the global kind of `nope_global`.
PI_KIND, GLOBAL_KIND = "pi", "dense"
_LAYER_ITEM = re.compile(r"([A-Za-z_][A-Za-z0-9_-]*)(?:\*(\d+))?")


def parse_layers(pattern: str, n_layer: int) -> tuple[str, ...]:
    """A layer pattern -> the kind of each of n_layer layers: comma-separated items "kind" or "kind*N" (N
    layers of it), the whole repeated over depth ("pi*3,dense" with 8 layers: pi, pi, pi, dense, pi, pi, pi,
    dense). One-line ValueError for an empty pattern or item, a count below 1, or a pattern whose length does
    not divide n_layer."""
    kinds = pattern_kinds(pattern)
    if n_layer % len(kinds):
        raise ValueError(f"layers {pattern!r} gives {len(kinds)} layers, which must divide n_layer ({n_layer}): "
                         f"the pattern repeats over depth")
    return kinds * (n_layer // len(kinds))


def pattern_kinds(pattern: str) -> tuple[str, ...]:
    """A layer pattern's kinds, one per layer of one repeat ("pi*2,dense" -> pi, pi, dense); `parse_layers`."""
    if not isinstance(pattern, str) or not pattern.strip():
        raise ValueError(f"layers must be a pattern of attention kinds like 'pi*3,dense', got {pattern!r}")
    kinds: list[str] = []
    for item in pattern.split(","):
        match = _LAYER_ITEM.fullmatch(item.strip())
        if match is None or (match.group(2) is not None and int(match.group(2)) < 1):
            raise ValueError(f"layers {pattern!r}: each item must be a kind or kind*N (N >= 1), got {item.strip()!r}")
        kinds += [match.group(1)] * int(match.group(2) or 1)
    return tuple(kinds)


def global_every_pattern(every: int, attention: str) -> str:
    """--global-every N as a layer pattern: N − 1 layers of `attention`, then a dense one ("dense" for N = 1)."""
    if not is_int(every) or every < 1:
        raise ValueError(f"--global-every must be an int >= 1, got {every!r}")
    return GLOBAL_KIND if every == 1 else f"{attention}*{every - 1},{GLOBAL_KIND}"


# The period schedules a config may name have one home, the reach analysis that designs them; the analysis
# sits below the configuration (it imports nothing of piattn but the masks), so this is a plain import.
PERIOD_SCHEDULES = SCHEDULES


# Period words resolved from the image width W (`geometry_periods`): [M]width[+K|-K], and neighbourhood.
_GEOMETRY = re.compile(r"(\d*)width([+-]\d+)?")
NEIGHBOURHOOD = ("neighbourhood", "neighborhood")


def is_geometry_period(period) -> bool:
    """Whether `period` is a word resolved from the image width: "width", "2width", "width-1", "2width+3",
    "neighbourhood" (or "neighborhood")."""
    return isinstance(period, str) and (period in NEIGHBOURHOOD or _GEOMETRY.fullmatch(period) is not None)


def geometry_periods(word: str, width: int | None, n_head: int) -> int | list[int]:
    """A period word -> the period(s) it means for images W = `width` pixels wide, raster-scanned:

    "width" W (the pixel above), "Mwidth" M·W (M rows up), "width-K" / "width+K" W ∓ K (the pixel above and
    K to the right / left; with M: M·W ± K); "neighbourhood" per-head periods W − 1, W, W + 1, 2W, repeated
    over the heads when n_head is a multiple of 4. One-line ValueError naming --period when the width is
    unknown (not an image), the heads do not fit, or a period comes out below 1.
    """
    if width is None:
        raise ValueError(f"--period {word} needs the image width, which only the image tasks set from their "
                         "data (image_width); give a number of tokens instead")
    if word in NEIGHBOURHOOD:
        if n_head % 4:
            raise ValueError(f"--period {word} gives 4 heads the periods W - 1, W, W + 1, 2W (W = {width}); it "
                             f"needs a number of heads that is a multiple of 4, got {n_head} (--n-head)")
        periods = [width - 1, width, width + 1, 2 * width] * (n_head // 4)
    else:
        match = _GEOMETRY.fullmatch(word)
        periods = [int(match.group(1) or 1) * width + int(match.group(2) or 0)]
    if min(periods) < 1:
        raise ValueError(f"--period {word} comes out below 1 for images {width} pixels wide: {periods}")
    return periods[0] if len(periods) == 1 else periods


def resolve_periods(period, *, window: int, n_layer: int, n_head: int, block_size: int,
                    pi_layers: list[int] | None = None) -> int | list:
    """A config's period -> the form it is stored in: an int when every head of every layer shares it, a
    list of n_head ints when every layer has the same heads, else a list of n_layer lists of n_head ints.

    period: an int; a list of n_head ints (every layer alike); a list of n_layer lists of n_head ints; or a
    schedule of `piattn.analysis.multiscale.schedule`, "name" or "name:N": "single" (every head π = N),
    "geometric" (heads at N, 2N, 4N, … in every layer), N defaulting to the default period 16; "cover"
    (`design_periods`: every lag up to N reachable through the layers), N defaulting to block_size − 1,
    the longest lag a sequence of the model has. One-line ValueError naming `period` for anything else.
    pi_layers: in a hybrid stack, the layers that are π layers: "cover" is designed over those alone (the
    other layers take the first π layer's periods, which they do not read).
    """
    if not is_int(period) and not isinstance(period, (str, list, tuple)):
        raise ValueError(f"period must be an int, a list of n_head ints, a list of n_layer lists of n_head ints "
                         f"or a schedule name ({', '.join(PERIOD_SCHEDULES)}), got {period!r}")
    if is_int(period) and period < 1:
        raise ValueError(f"period must be an int >= 1, got {period!r}")
    if isinstance(period, str):
        name, _, arg = period.partition(":")
        if name not in PERIOD_SCHEDULES or (arg and not arg.isdigit()):
            raise ValueError(f"period schedule must be one of {', '.join(PERIOD_SCHEDULES)}, optionally with ':N' "
                             f"(N an int: the period, or cover's target lag), got {period!r}")
        n = int(arg) if arg else (block_size - 1 if name == "cover" else PI_DEFAULTS.period)
        given = dict(target=n) if name == "cover" else dict(period=n)
        designed = n_layer if pi_layers is None or name != "cover" else len(pi_layers)
        try:
            resolved = schedule(name, window, designed, n_head, **given) if designed else ()
        except ValueError as e:
            raise ValueError(f"period {period!r}: {e}") from None
        if designed != n_layer:  # a hybrid's π layers take the design in order, the others its first layer
            fill = resolved[0] if resolved else (PI_DEFAULTS.period,) * n_head
            by_layer = dict(zip(pi_layers, resolved, strict=True))
            resolved = [by_layer.get(i, fill) for i in range(n_layer)]
    else:
        resolved = periods_per_layer(period, n_layer, n_head)
    layers = [list(heads) for heads in resolved]
    if all(heads == layers[0] for heads in layers):
        return layers[0][0] if len(set(layers[0])) == 1 else layers[0]
    return layers


@dataclass
class GPTConfig(ModelConfig):
    """Configuration of the causal language model `piattn.models.GPT`."""


@dataclass
class EncoderConfig(ModelConfig):
    """Configuration of the bidirectional encoder classifier `piattn.models.Encoder`.

    num_classes: size of the output; pool: "mean" over valid tokens or "cls" (the first token);
    dual: encode two sequences with shared weights and classify [u, v, u·v, |u − v|] (LRA Retrieval).
    """

    num_classes: int = 2
    pool: str = "mean"
    dual: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.pool not in ("mean", "cls"):
            raise ValueError(f"pool must be 'mean' or 'cls', got {self.pool!r}")
        if not is_int(self.num_classes) or self.num_classes < 2:
            raise ValueError(f"num_classes must be an integer >= 2, got {self.num_classes!r}")
