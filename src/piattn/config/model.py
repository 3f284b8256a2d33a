"""Model configurations: one dataclass of every knob, and the named sizes of the paper's Table app_model.

The attention kind is picked by name (`attention`, a key of `piattn.layers.ATTENTION`, checked when a
model is built); each kind reads the fields it needs, so a model never changes to gain a new kind.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

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
    A layer takes the shared settings of its kind (window, sinks, its periods) unless its item gives it its own
    in parentheses: "local(window=1024)*5,dense", "pi(window=64, period=128, sinks=4)*3,dense" (keys window,
    sinks, period, each for the kinds that take it; `layer_config(i)` is the config layer i is built from). The
    stored `layers` is the pattern as given. nope_global: no RoPE on the dense (global) layers (NoPE, as Llama 4
    and Command A); a `period` schedule "cover" is designed for the π layers only (a dense layer reaches every
    lag by itself), for their one window (refused when their items give them different windows or periods).
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
        # The settings each layer's pattern item gives it in place of the shared ones ({} for most).
        self._own = (({},) * self.n_layer if self.layers is None
                     else tuple(item.settings for item in layer_items(self.layers, self.n_layer)))
        if is_geometry_period(self.period):
            self.period = geometry_periods(self.period, self.image_width, self.n_head)
        pi_layers = None if self.layers is None else [i for i, kind in enumerate(kinds) if kind == PI_KIND]
        self.period = resolve_periods(self.period, window=self._designed_window(pi_layers), n_layer=self.n_layer,
                                      n_head=self.n_head, block_size=self.block_size, pi_layers=pi_layers)
        # Every layer's operator settings, built (and so checked) once, here: a π layer is handed its own object
        # (`pi_settings`), with the window, sinks and period its pattern item gives it.
        shared = layer_settings(periods_per_layer(self.period, self.n_layer, self.n_head),
                                window=self.window, variant=self.variant, prior=self.prior,
                                logit_clamp=self.logit_clamp, eps=self.gate_eps, sinks=self.sinks)
        self._pi_layers = tuple(dataclasses.replace(settings, **own) if own else settings
                                for settings, own in zip(shared, self._own, strict=True))

    def _designed_window(self, pi_layers: list[int] | None) -> int:
        """The window a period schedule is designed for: the shared one, or in a hybrid stack the narrowest
        window of its π layers. A "cover" design for the narrowest window covers its target whatever wider
        windows the other π layers have: a wider window only adds lags to a layer's hops, so the sum set over
        the layers only grows. ValueError naming `period` and `layers` when the π layers' items give them
        periods of their own (a designed schedule and given periods cannot both hold)."""
        cover = isinstance(self.period, str) and self.period.partition(":")[0] == "cover"
        if pi_layers is None or not cover:  # the other schedules read no window
            return self.window
        if any("period" in self._own[i] for i in pi_layers):
            raise ValueError(f"period {self.period!r} designs the periods of the π layers, but layers "
                             f"{self.layers!r} gives them periods of their own: give the periods (--period, or "
                             "period= in the items) or the schedule, not both")
        return min((self._own[i].get("window", self.window) for i in pi_layers), default=self.window)

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
        """The π-Attention operator settings of layer 0 (layers differ in their periods, and in a hybrid stack in
        the settings their pattern items give them)."""
        return self.pi_settings(0)

    def pi_settings(self, layer: int) -> PiSettings:
        """The π-Attention operator settings of layer `layer`: the one `PiSettings` built and checked when the
        config was made (from window, variant, prior, logit_clamp, gate_eps, sinks and that layer's n_head
        periods, `periods_per_layer` reading every stored form, then the window, sinks and period its pattern
        item gives it), which a π layer takes whole (`PiAttention.config_kwargs`). Its period is an int, or a
        tuple of n_head per-head periods. A config is not changed once made: another is made
        (`dataclasses.replace`, `from_dict`), with its own settings."""
        return self._pi_layers[layer]

    def layer_config(self, layer: int) -> ModelConfig:
        """The config as layer `layer` takes it: this one with the window, sinks and period its pattern item
        gives it in place of the shared ones ("local(window=16),dense": window 16 for layer 0), or this one itself
        for a layer whose item gives none. What the layer is built from (`piattn.models.block.Block`); read only
        layer `layer` of it (its `pi_settings(layer)` is this config's). `layer_fields` is the same for a stored
        model's fields."""
        own = self._own[layer]
        return dataclasses.replace(self, **own) if own else self

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
# An item of a layer pattern: a kind, its own settings in parentheses, a count ("local(window=16)*2").
_LAYER_ITEM = re.compile(r"([A-Za-z_][A-Za-z0-9_-]*)(?:\(([^()]*)\))?(?:\*(\d+))?")
# The settings an item may give its layers, each with its lowest value: `ModelConfig` fields, taken only by the
# kinds that take the field (the registry answers which: `check_pattern_settings`).
LAYER_SETTINGS: dict[str, int] = {"window": 0, "sinks": 0, "period": 1}
LAYER_SETTINGS_ALLOWED = ", ".join(f"{key} (an int >= {low})" for key, low in LAYER_SETTINGS.items())


class LayerItem(NamedTuple):
    """One layer of a layer pattern: its kind, the settings its item gives it in place of the shared ones
    ({"window": 16} for "local(window=16)"; not to be changed: the layers of "kind(...)*N" share it), and the
    item as written, for messages."""

    kind: str
    settings: Mapping[str, int]
    text: str


def parse_layers(pattern: str, n_layer: int) -> tuple[str, ...]:
    """A layer pattern -> the kind of each of n_layer layers: comma-separated items "kind" or "kind*N" (N
    layers of it), the whole repeated over depth ("pi*3,dense" with 8 layers: pi, pi, pi, dense, pi, pi, pi,
    dense); an item may give its layers their own settings, "local(window=16)*2" (`layer_items`). One-line
    ValueError for an empty pattern or item, a count below 1, malformed settings, or a pattern whose length does
    not divide n_layer."""
    return tuple(item.kind for item in layer_items(pattern, n_layer))


def layer_items(pattern: str, n_layer: int) -> tuple[LayerItem, ...]:
    """A layer pattern -> the `LayerItem` of each of n_layer layers, the pattern repeated over depth."""
    items = pattern_items(pattern)
    if n_layer % len(items):
        raise ValueError(f"layers {pattern!r} gives {len(items)} layers, which must divide n_layer ({n_layer}): "
                         f"the pattern repeats over depth")
    return items * (n_layer // len(items))


def pattern_kinds(pattern: str) -> tuple[str, ...]:
    """A layer pattern's kinds, one per layer of one repeat ("pi*2,dense" -> pi, pi, dense); `parse_layers`."""
    return tuple(item.kind for item in pattern_items(pattern))


def pattern_items(pattern: str) -> tuple[LayerItem, ...]:
    """A layer pattern's `LayerItem`s, one per layer of one repeat: items split on the commas outside
    parentheses, each "kind", "kind*N", "kind(key=value, ...)" or "kind(key=value, ...)*N" with the keys of
    LAYER_SETTINGS ("pi(window=64, period=128)*3,dense"). One-line ValueError naming `layers`, the item and what
    it allows for anything else."""
    if not isinstance(pattern, str) or not pattern.strip():
        raise ValueError(f"layers must be a pattern of attention kinds like 'pi*3,dense', got {pattern!r}")
    items: list[LayerItem] = []
    for text in split_items(pattern):
        match = _LAYER_ITEM.fullmatch(text)
        if match is None or (match.group(3) is not None and int(match.group(3)) < 1):
            raise ValueError(f"layers {pattern!r}: each item must be a kind or kind*N (N >= 1), with settings "
                             f"kind(key=value, ...) or kind(key=value, ...)*N, got {text!r}")
        kind, settings, count = match.group(1), match.group(2), int(match.group(3) or 1)
        own = {} if settings is None else item_settings(pattern, text, settings)
        items += [LayerItem(kind, own, text)] * count
    return tuple(items)


def split_items(pattern: str) -> list[str]:
    """A layer pattern's items, stripped: split on the commas outside parentheses (those inside belong to the
    item's settings). One-line ValueError for unbalanced or nested parentheses."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(pattern + ","):  # the comma closes the last item
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth not in (0, 1) or (i == len(pattern) and depth):
            raise ValueError(f"layers {pattern!r}: {'nested' if depth > 1 else 'unbalanced'} parentheses; an item's "
                             f"settings go in one pair after its kind, like 'local(window=16)*2'")
        if char == "," and depth == 0:
            items.append(pattern[start:i].strip())
            start = i + 1
    return items


def item_settings(pattern: str, item: str, text: str) -> dict[str, int]:
    """The settings inside an item's parentheses, "window=64, sinks=4" -> {"window": 64, "sinks": 4}. One-line
    ValueError naming `layers` and the item for a part that is not key=value, an unknown or repeated key, or a
    value that is not an int at least the key's lowest (LAYER_SETTINGS)."""
    settings: dict[str, int] = {}
    for part in text.split(","):
        key, equals, value = (s.strip() for s in part.partition("="))
        where = f"layers {pattern!r}, item {item!r}"
        if not equals or key not in LAYER_SETTINGS:
            raise ValueError(f"{where}: settings are key=value with keys {LAYER_SETTINGS_ALLOWED}, got "
                             f"{part.strip()!r}")
        if key in settings:
            raise ValueError(f"{where}: {key} is given twice")
        if not re.fullmatch(r"\d+", value) or int(value) < LAYER_SETTINGS[key]:
            raise ValueError(f"{where}: {key} must be an int >= {LAYER_SETTINGS[key]}, got {value!r}")
        settings[key] = int(value)
    return settings


def check_pattern_settings(pattern: str | None, having: Callable[[str], Iterable[str]]) -> None:
    """ValueError naming `layers`, the item and the settings its kind takes, for an item that gives its kind a
    setting the kind does not take ("dense(window=4)"). having(setting): the kinds that take a setting, which
    the registry of kinds answers (`piattn.layers.kinds_with`, or a training flags' `Registry.having`), the one
    source the flags scoped to a setting's kinds read too."""
    if pattern is None:
        return
    for item in {item.text: item for item in pattern_items(pattern)}.values():
        taking = {key: tuple(having(key)) for key in item.settings}
        refused = [key for key in item.settings if item.kind not in taking[key]]
        if refused:
            takes = ", ".join(key for key in LAYER_SETTINGS if item.kind in tuple(having(key)))
            raise ValueError(f"layers {pattern!r}, item {item.text!r}: {item.kind} takes no {refused[0]} (kinds "
                             f"that take it: {', '.join(taking[refused[0]])}); {item.kind} takes "
                             f"{takes or 'none of ' + ', '.join(LAYER_SETTINGS)}")


def layer_fields(model: Mapping[str, Any], layer: int) -> dict[str, Any]:
    """The fields of a model (`ModelConfig.to_dict()`, a checkpoint's config "model") as its layer `layer` takes
    them: the settings its pattern item gives it (`layers`, "local(window=16),dense") in place of the shared
    window, sinks and period; the others as they are. What the analyses of a stored model read per layer
    (`piattn.layers.model_reach`); `ModelConfig.layer_config` is the same for a config."""
    if not model.get("layers"):
        return dict(model)
    return {**model, **layer_items(model["layers"], model["n_layer"])[layer].settings}


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
