"""The configuration of a training run: five sections of flags (model, data, task, optim, run).

Every `piattn train` flag is one field below; `piattn.config.flags` turns the fields into the argparse
arguments, the range checks, the per-task and per-attention scope checks and the `--resume` comparison.
A checkpoint stores the flat field dict (`to_flat`); field names are unique across sections. A flag scoped
to attention kinds names the capability they need (`Capability`), never the kinds: the registry of
attention kinds (`piattn.layers.registry`) answers which have it.
"""

from __future__ import annotations

import argparse
import dataclasses
import textwrap
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..checks import is_int
from .flags import Capability, add_flags, applies, check_flags, flag, flag_fields, option_name
from .model import PERIOD_SCHEDULES, SIZES, ModelConfig
from .pi import PI_DEFAULTS, VARIANTS

# Task families whose flags only they read.
CLASSIFICATION = ("listops", "pathfinder", "retrieval", "reach")
# Tasks with fixed splits of examples, generated from --data-seed or read at most --train-size / --eval-size.
FIXED_SPLITS = (*CLASSIFICATION, "vl-retrieval", "recall", "mqar")
PRECISIONS = ("auto", "fp32", "bf16")


@dataclass
class ModelFlags:
    config: str = flag("tiny", "model size", choices=tuple(SIZES))
    attention: str = flag("pi", "attention kind", choices="attention")
    window: int | None = flag(None, "local window k (default: the config's, 4)", low=0,
                              applies={"attention": Capability("window")})
    period: str | None = flag(None, "π, the distance of the long-range key (default 16; vl-retrieval: the "
                              "image's patches per row, so the skip key is the patch above / below); or one "
                              "per head, '8,16,32,64'; or per layer, '5,6,7,8/9,14,19,24'; or a schedule: "
                              "single[:N], geometric[:N] (N, 2N, 4N, ...) or cover[:N] (every lag up to N, "
                              "default seq-len - 1)", applies={"attention": Capability("period")})
    variant: str | None = flag(None, "π-Attention fusion variant (default adaptive)", choices=VARIANTS,
                               applies={"attention": Capability("variant")})
    prior: float | None = flag(None, "the fixed local prior α of --variant fixed (default 0.5)", above=0, high=1,
                               applies={"attention": Capability("prior"), "variant": ("fixed",)})
    n_layer: int | None = flag(None, "number of layers (default: the --config's)", low=1)
    n_head: int | None = flag(None, "number of heads (default: the --config's)", low=1)
    n_kv_head: int | None = flag(None, "key/value heads, dividing the heads (grouped-query attention; default: as "
                                 "many as heads)", low=1, applies={"attention": Capability("grouped_query")})
    sinks: int | None = flag(None, "sink keys: the first N tokens of each document, seen by every later query "
                             "(default 0)", low=0, applies={"attention": Capability("sinks")})
    d_model: int | None = flag(None, "width (default: the --config's)", low=1)
    # The size's own d_ff, also under --d-model: 4 × d-model holds for the named sizes only.
    d_ff: int | None = flag(None, "feed-forward width (default: the --config's, 4 × its width, kept when "
                            "--d-model changes)", low=1)
    backend: str | None = flag(None, "π operator backend (default auto)", choices="backend",
                               applies={"attention": Capability("backend")})
    dropout: float = flag(0.1, "residual, attention and FFN dropout", low=0, below=1)

    def __post_init__(self):
        if is_int(self.period):  # a checkpoint written before --period took text stores an int
            self.period = str(self.period)

    def model_fields(self) -> dict:
        """The `ModelConfig` fields these flags set (every flag named like a field, when given), for
        `ModelConfig.from_name(config, ...)`: a new model flag needs no code here."""
        fields = {f.name for f in dataclasses.fields(ModelConfig)}
        given = {k: v for k, v in dataclasses.asdict(self).items() if k in fields and v is not None}
        if "period" in given:
            given["period"] = parse_period(given["period"])
        return given


def parse_period(text: str) -> int | list | str:
    """--period's text -> a `ModelConfig.period`: "16" -> 16, "8,16,32,64" -> one period per head,
    "5,6,7,8/9,14,19,24" -> per layer ('/' between layers), a schedule name ("cover", "geometric:8") as is
    (`ModelConfig` resolves it, and checks the counts against the model). One-line ValueError otherwise."""
    text = text.strip()
    if text.split(":")[0] in PERIOD_SCHEDULES:
        return text
    try:
        layers = [[int(p) for p in layer.split(",")] for layer in text.split("/")]
    except ValueError:
        layers = None
    if layers is None or any(p < 1 for layer in layers for p in layer):
        raise ValueError(f"--period must be an int >= 1, per-head ints '8,16,32,64', per-layer '5,6,7,8/9,14,19,24' "
                         f"or a schedule ({', '.join(PERIOD_SCHEDULES)}, optionally ':N'), got {text!r}")
    if "/" in text:
        return layers
    return layers[0][0] if len(layers[0]) == 1 else layers[0]


def period_text(periods) -> str:
    """Periods in the syntax `piattn train --period` takes, `parse_period`'s inverse: an int (every head), a
    list of ints (one per head, every layer alike: '8,16,32,64') or per-layer lists ('5,6,7,8/9,14,19,24')."""
    if isinstance(periods, int):
        return str(periods)
    if periods and isinstance(periods[0], (list, tuple)):
        return "/".join(",".join(map(str, heads)) for heads in periods)
    return ",".join(map(str, periods))


@dataclass
class DataFlags:
    data: str | None = flag(None, "lm (required): a folder with train/ validation/ test/ text files, books:<dir>, "
                            "wikitext:<dir>, hf:<name>; listops: a folder with LRA's basic_{train,val,test}.tsv "
                            "(default: generated); retrieval (required): a folder with LRA's new_aan_pairs.*.tsv; "
                            "vl-retrieval: shapes (default, generated), coco:DIR or flickr30k:DIR (Karpathy "
                            "splits: DIR/dataset_coco.json or DIR/dataset_flickr30k.json and the images)")
    tokenizer: str = flag("byte", "tokenizer kind", choices="tokenizer", applies={"task": ("lm",)})
    vocab_size: int | None = flag(None, "BPE vocabulary size (required with --tokenizer bpe)", low=256,
                                  applies={"task": ("lm",), "tokenizer": ("bpe",)})
    seq_len: int | None = flag(None, "tokens per sequence (default: lm 1024, listops 2000, retrieval 4000 per "
                               "text, pathfinder image-size², reach, recall and mqar 64, vl-retrieval (image-size / "
                               "patch-size)², the image's patches)", low=1)
    cross_documents: bool = flag(False, "let sequences span document boundaries", applies={"task": ("lm",)})
    pack_documents: bool = flag(False, "pack documents back to back into full sequences, attention kept inside "
                                "each document (document ids in the batch) and no target across a boundary",
                                applies={"task": ("lm",), "attention": Capability("documents")})
    cache_dir: str | None = flag(None, "where tokenized corpora are cached (default: OUT/cache)",
                                 defines_run=False, applies={"task": ("lm",)})


@dataclass
class TaskFlags:
    task: str = flag("lm", "what to learn", choices="task")
    train_size: int | None = flag(None, "training examples: generated (default 10000) or read at most (default "
                                  "all)", low=1, applies={"task": FIXED_SPLITS})
    eval_size: int | None = flag(None, "examples of the validation and of the test split: generated (default "
                                 "1000) or read at most (default all); vl-retrieval: images", low=1,
                                 applies={"task": FIXED_SPLITS})
    data_seed: int = flag(0, "seed of generated splits (each split its own)", low=0,
                          applies={"task": FIXED_SPLITS})
    listops_min_len: int | None = flag(None, "fewest tokens of a generated ListOps expression (default "
                                       "seq-len / 4 + 1)", low=1, applies={"task": ("listops",)})
    listops_max_len: int | None = flag(None, "most tokens of a generated ListOps expression (default seq-len - 1)",
                                       low=1, applies={"task": ("listops",)})
    image_size: int | None = flag(None, "image side in pixels (default: pathfinder 32; vl-retrieval shapes 32, "
                                  "coco / flickr30k 224)", low=1, applies={"task": ("pathfinder", "vl-retrieval")})
    contour_length: int | None = flag(None, "Pathfinder paddles per target curve (LRA: 6, 9, 14; default 14)",
                                      low=1, applies={"task": ("pathfinder",)})
    lag: int | None = flag(None, "reach: positions from the answer to the query (required)", low=1,
                           applies={"task": ("reach",)})
    reach_vocab: int | None = flag(None, "reach: symbols in a sequence (default 8; chance 1/vocab)", low=2,
                                   high=2**15 - 1, applies={"task": ("reach",)})
    causal: bool | None = flag(None, "reach: a causal GPT read at the query (default) or, with --no-causal, a "
                               "bidirectional Encoder", applies={"task": ("reach",)})
    recall_symbols: int | None = flag(None, "recall: symbols of the filler and the values (default 8; chance "
                                      "1/symbols)", low=2, high=2**15 - 3, applies={"task": ("recall",)})
    lag_min: int | None = flag(None, "recall: the shortest lag from the value to the query (default: the "
                               "least there is room for, 1 or 2)", low=1,
                               applies={"task": ("recall",)})
    lag_max: int | None = flag(None, "recall: the longest lag from the value to the query (default: the "
                               "most there is room for, seq-len - 2 or - 1)",
                               low=1, applies={"task": ("recall",)})
    recall_order: str | None = flag(None, "recall: marker-value (default: the marker, then the value) or "
                                    "value-marker (the marker right after the value; lags from 2)",
                                    choices=("marker-value", "value-marker"), applies={"task": ("recall",)})
    recall_loss: str | None = flag(None, "recall: where training asks for the value: query (the last position "
                                   "only, default) or every (also every position lag-min … lag-max after it, each "
                                   "at its own lag; evaluation always reads the query)", choices=("query", "every"),
                                   applies={"task": ("recall",)})
    mqar_pairs: str | None = flag(None, "mqar: key–value pairs per sequence: a count '8', a list '8,16,32,64' or "
                                  "a range '8-64' (each example draws one; validation and test hold each equally "
                                  "often); every count <= seq-len / 4 (default 8)", applies={"task": ("mqar",)})
    mqar_keys: int | None = flag(None, "mqar: size of the key vocabulary, >= the most pairs (default 64)", low=1,
                                 applies={"task": ("mqar",)})
    mqar_values: int | None = flag(None, "mqar: size of the value vocabulary (default 64; chance 1/values)",
                                   low=1, applies={"task": ("mqar",)})
    mqar_distance: str | None = flag(None, "mqar: where each query sits from its key: uniform (default: anywhere "
                                     "after the pairs) or distance bins 'LO-HI[,LO-HI...]' (each example draws one "
                                     "bin for all its pairs; validation and test hold each equally often)",
                                     applies={"task": ("mqar",)})
    patch_size: int | None = flag(None, "vl-retrieval: side of an image patch in pixels, dividing --image-size "
                                  "(default: shapes 4, coco / flickr30k 16)", low=1,
                                  applies={"task": ("vl-retrieval",)})
    caption_len: int | None = flag(None, "vl-retrieval: UTF-8 bytes kept of a caption (default 64)", low=1,
                                   applies={"task": ("vl-retrieval",)})
    embed_dim: int | None = flag(None, "vl-retrieval: width of the shared image-text space (default d-model)",
                                 low=2, applies={"task": ("vl-retrieval",)})
    text_attention: str | None = flag(None, "vl-retrieval: attention kind of the text tower (default dense; "
                                      "--attention is the image tower's)", choices="attention",
                                      applies={"task": ("vl-retrieval",)})


@dataclass
class OptimFlags:
    batch_size: int = flag(8, "sequences per micro batch on each process", low=1)
    grad_accum: int = flag(1, "micro batches per optimiser step", low=1)
    # Not run-defining: --resume may extend a run (the schedule's rule is in the help).
    steps: int = flag(2000, "optimiser steps in the whole run; may change on --resume, which then continues on "
                      "the schedule of the new --steps: warmup, then the cosine from --lr at --warmup to --min-lr "
                      "at the new --steps, so extending a run raises the LR from where the old schedule had it "
                      "(a finished run: from --min-lr) to the new schedule's value at the step reached", low=1,
                      defines_run=False)
    lr: float = flag(3e-4, "peak learning rate", low=0)
    min_lr: float = flag(3e-5, "learning rate at the end of the cosine", low=0)
    warmup: int = flag(100, "linear warmup steps (the paper: 2000 of 200k)", low=0)
    weight_decay: float = flag(0.1, "AdamW decay of Linear weights", low=0)
    clip: float = flag(1.0, "global gradient-norm clip (0: none)", low=0)
    seed: int = flag(0, "seed of initialisation, dropout and data order", low=0)


@dataclass
class RunFlags:
    out: str | None = flag(None, "run directory (checkpoints, metrics.jsonl, tokenizer, cache)", required=True,
                           defines_run=False)
    resume: bool = flag(False, "continue the run in --out from its latest checkpoint, with the settings stored "
                        "there: other flags need not be given; one given again must have its stored value, except "
                        "--steps, --cache-dir and the flags of this group, which may change; an --out without "
                        "checkpoints is an error", defines_run=False)
    eval_every: int = flag(500, "validate every N steps and at the end (0: never)", low=0, defines_run=False)
    eval_batches: int = flag(20, "validation batches per process (0: all)", low=0, defines_run=False)
    save_every: int = flag(1000, "checkpoint every N steps (0: at the end only)", low=0, defines_run=False)
    keep: int = flag(3, "checkpoints to keep", low=1, defines_run=False)
    log_every: int = flag(10, "write training metrics every N steps", low=1, defines_run=False)
    device: str = flag("auto", "auto, cpu, cuda or cuda:N", defines_run=False)
    sequence_parallel: int = flag(1, "ranks that share each sequence (under torchrun), each taking seq-len / N "
                                  "contiguous positions; the world size must be a multiple of N", low=1,
                                  defines_run=False,
                                  applies={"task": ("lm",), "attention": Capability("sequence_parallel")})
    fsdp: bool = flag(False, "shard weights, gradients and optimiser state over the processes (FSDP2) "
                      "instead of replicating them (DDP); checkpoints hold the full state as without it; "
                      "nothing to shard on one process", defines_run=False)
    precision: str = flag("auto", "auto (bf16 on capable GPUs), fp32 or bf16", choices=PRECISIONS,
                          defines_run=False)
    progress: bool = flag(True, "progress bar", defines_run=False)


SECTIONS = {"model": ModelFlags, "data": DataFlags, "task": TaskFlags, "optim": OptimFlags, "run": RunFlags}
GROUP_TITLES = {"model": "model", "data": "data", "task": "tasks", "optim": "optimisation (paper defaults)",
                "run": "run (may change on --resume)"}


@dataclass
class TrainConfig:
    """Every setting of a training run, by section. Build with `from_args`, `from_flat` or keywords."""

    model: ModelFlags = dataclasses.field(default_factory=ModelFlags)
    data: DataFlags = dataclasses.field(default_factory=DataFlags)
    task: TaskFlags = dataclasses.field(default_factory=TaskFlags)
    optim: OptimFlags = dataclasses.field(default_factory=OptimFlags)
    run: RunFlags = dataclasses.field(default_factory=RunFlags)

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser, registries: Mapping[str, Iterable] | None = None
                      ) -> dict[str, argparse._ArgumentGroup]:
        """One argument group per section (returned by section name); `registries` as in `check`, for the
        choices --help lists. A flag not given is absent from the parsed namespace (`given`)."""
        groups = {section: parser.add_argument_group(GROUP_TITLES[section]) for section in SECTIONS}
        for section, cls in SECTIONS.items():
            add_flags(groups[section], cls, registries)
        return groups

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TrainConfig:
        """The parsed flags, the defaults for those not given."""
        return cls.from_flat(cls.given(args))

    @staticmethod
    def given(args: argparse.Namespace) -> dict:
        """{field: value} of the flags given on the command line (those not given are absent from `args`)."""
        return {k: v for k, v in vars(args).items() if k in _FIELD_SECTION}

    @classmethod
    def from_flat(cls, values: Mapping) -> TrainConfig:
        """From a flat {field: value} dict (a checkpoint's `train_args`); missing fields take defaults,
        unknown ones are a ValueError naming them."""
        unknown = sorted(set(values) - set(_FIELD_SECTION))
        if unknown:
            raise ValueError(f"unknown training settings {unknown}")
        parts = {section: {} for section in SECTIONS}
        for name, value in values.items():
            parts[_FIELD_SECTION[name]][name] = value
        return cls(**{section: SECTIONS[section](**kw) for section, kw in parts.items()})

    def to_flat(self) -> dict:
        return {name: value for section in SECTIONS
                for name, value in dataclasses.asdict(getattr(self, section)).items()}

    def check(self, registries: Mapping[str, Iterable] | None = None) -> None:
        """ValueError naming the flag for any value out of range, not a choice, or given where it is ignored.

        registries: the allowed names of "attention", "task", "tokenizer" and "backend", known above here; the
        attention kinds as a `flags.Registry` that also says which kinds have a capability.
        """
        flat = self.to_flat()
        context = {**flat, "variant": flat["variant"] or PI_DEFAULTS.variant}
        for section in SECTIONS:
            check_flags(getattr(self, section), registries, context)

    def differences(self, other: TrainConfig) -> list[tuple[str, object, object]]:
        """(flag, my value, other's value) for each run-defining flag whose values differ."""
        mine, theirs = self.to_flat(), other.to_flat()
        return [(option_name(name), mine[name], theirs[name]) for name in RUN_DEFINING if mine[name] != theirs[name]]

    def resumed_with(self, given: Mapping) -> TrainConfig:
        """This stored configuration of a run, continued with the flags `given` ({field: value}) by `--resume`.

        A run-defining flag given again must have the stored value (ValueError naming each that differs,
        stored vs given); the others (`--steps`, `--cache-dir`, the run section) take the given value.
        """
        stored = self.to_flat()
        differing = [f"{option_name(name)}: stored {stored[name]!r}, given {value!r}"
                     for name, value in given.items() if name in RUN_DEFINING and value != stored[name]]
        if differing:
            raise ValueError("--resume continues the run with its stored settings; these differ: "
                             + "; ".join(differing) + " (drop them, or start a new run in another --out)")
        return TrainConfig.from_flat({**stored, **given, "resume": True})

    def warnings(self) -> list[str]:
        """Settings that are allowed but probably not meant, one line each."""
        o = self.optim
        if o.warmup >= o.steps:
            return [f"--warmup {o.warmup} >= --steps {o.steps}: the learning rate never reaches the end of its "
                    f"warmup ramp (peak --lr {o.lr:g}) and the cosine decay never starts; lower --warmup"]
        return []

    def describe(self, model: Mapping | None = None, width: int = 110, registries: Mapping | None = None) -> str:
        """The settings as one compact block, a line per section of `--flag value` pairs (flags left to the
        task or model config omitted; `model`: the built model's config, whose values fill in the model
        flags left to it that apply to this attention kind; `registries` as in `check`)."""
        context = {**self.to_flat(), **({"variant": model.get("variant")} if model else {})}
        lines = []
        for section, cls in SECTIONS.items():
            pairs = []
            for f, meta in flag_fields(cls):
                value = getattr(getattr(self, section), f.name)
                if value is None and model is not None and f.name in model and applies(meta, context, registries):
                    value = model[f.name]
                if (value is None or (value is False and f.default is False) or f.name == "resume"
                        or not applies(meta, context, registries)):
                    continue
                if isinstance(value, bool):
                    pairs.append(option_name(f.name) if value else f"--no-{f.name.replace('_', '-')}")
                else:
                    pairs.append(f"{option_name(f.name)} {value}")
            # no-break spaces inside a pair: lines break between pairs only
            text = textwrap.fill(", ".join(p.replace(" ", "\xa0") for p in pairs), width,
                                 initial_indent=f"  {section:<6} ", subsequent_indent=" " * 9, break_on_hyphens=False)
            lines.append(text.replace("\xa0", " "))
        return "\n".join(lines)


_FIELD_SECTION = {f.name: section for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
RUN_DEFINING = tuple(f.name for cls in SECTIONS.values() for f, meta in flag_fields(cls) if meta.defines_run)
