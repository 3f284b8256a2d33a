"""Image-text retrieval on the generated shapes: image attention local vs π vs dense at one budget, 2 seeds.

Each run is `piattn train --task vl-retrieval --data shapes` (a CLIP dual encoder; the image tower's
attention is the kind compared, the text tower is dense for all), then `piattn eval` on the test split
(1,000 images, 5,000 captions). Runs already finished are kept, so an interrupted sweep resumes.

Beside the runs, two reference rows computed from the test split itself: chance (R@K = K / candidates),
and the best any model can score when it knows (a) only which two objects an image holds, (b) the objects
and their relation. Different images can share a description word for word (there are 18 · 17 · 2 = 612
of them: 18 coloured shapes, two axes), so even (b) stays below 1; a model above (a) has used the
relation, i.e. related the two objects.

    python experiments/vl_shapes.py --runs runs/vl_shapes --out experiments/results/vl_shapes.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
from runs import train_and_test

from piattn.data import shapes
from piattn.tasks.ranking import retrieval_recalls

KEYS = ("i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10")
MODEL = {"n_layer": 2, "d_model": 64, "n_head": 2, "window": 4, "image_size": 32, "patch_size": 4}
EVAL_SIZE = 1000
TEST_SEED = 2  # the test split of --data-seed 0: 3·0 + 2


def train_argv(kind: str, seed: int, steps: int, batch: int, run: Path) -> list[str]:
    window = ["--window", str(MODEL["window"])] if kind != "dense" else []
    return ["train", "--task", "vl-retrieval", "--data", "shapes", "--attention", kind, *window,
            "--n-layer", str(MODEL["n_layer"]), "--d-model", str(MODEL["d_model"]), "--n-head", str(MODEL["n_head"]),
            "--image-size", str(MODEL["image_size"]), "--patch-size", str(MODEL["patch_size"]),
            "--train-size", "10000", "--eval-size", str(EVAL_SIZE), "--batch-size", str(batch), "--steps", str(steps),
            "--lr", "1e-3", "--min-lr", "1e-4", "--warmup", "30", "--dropout", "0", "--eval-every", "0",
            "--save-every", "0", "--seed", str(seed), "--device", "cpu", "--no-progress", "--out", str(run)]


def last_train_record(run: Path) -> dict:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("split") == "train"][-1]


def oracle(captions: list[str], caption_image: torch.Tensor, relation: bool) -> dict[str, float]:
    """Recall of a model that embeds each image and caption as its description, one-hot: the objects and their
    relation, or (relation=False) the two objects only. Equal descriptions are told apart at random (tiny
    seeded noise), except captions equal word for word, which any model embeds alike (an exact tie)."""
    n = len(caption_image) // 5
    keys = [frozenset(captions[5 * i:5 * i + 2]) if relation else frozenset(captions[5 * i + 4][2:].split(" and a "))
            for i in range(n)]
    index = {key: j for j, key in enumerate(sorted(set(keys), key=sorted))}
    images = torch.nn.functional.one_hot(torch.tensor([index[k] for k in keys]), len(index)).double()
    generator = torch.Generator().manual_seed(0)
    texts = {text: j for j, text in enumerate(dict.fromkeys(captions))}
    text_noise = torch.randn(len(texts), len(index), generator=generator, dtype=torch.float64)
    image_noise = torch.randn(images.shape, generator=generator, dtype=torch.float64)
    caption_emb = images.repeat_interleave(5, 0) + 1e-6 * text_noise[[texts[t] for t in captions]]
    return retrieval_recalls(images + 1e-6 * image_noise, caption_emb, caption_image)


def mean_std(values: list[float]) -> str:
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}" if len(values) > 1 else f"{values[0]:.3f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=Path, default=Path("runs/vl_shapes"))
    parser.add_argument("--out", type=Path, help="markdown table to write (JSON beside it)")
    parser.add_argument("--kinds", nargs="+", default=["local", "pi", "dense"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (a shared CPU: 1)")
    args = parser.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # read by each run's interpreter at start-up
    rows = []
    for kind in args.kinds:
        for seed in args.seeds:
            run = args.runs / f"{kind}-seed{seed}"
            result = train_and_test(run, train_argv(kind, seed, args.steps, args.batch_size, run))
            train = last_train_record(run)
            rows.append({"attention": kind, "seed": seed, **{k: result[k] for k in KEYS},
                         "train_loss": train["loss"], "train_seconds": train["wall_seconds"],
                         "examples": train["step"] * args.batch_size, "steps": train["step"]})
            print(f"{kind:6s} seed {seed}: " + " ".join(f"{k} {result[k]:.3f}" for k in KEYS), flush=True)
    test = shapes.generate(EVAL_SIZE, TEST_SEED, MODEL["image_size"])
    references = {"chance (K / candidates)": {k: int(k.split("_r")[1]) / EVAL_SIZE for k in KEYS},
                  "objects only (best possible)": oracle(test.captions, test.caption_image, relation=False),
                  "objects + relation (best possible)": oracle(test.captions, test.caption_image, relation=True)}
    m, pairs = MODEL, args.steps * args.batch_size
    lines = [f"Dual encoder: image tower {m['n_layer']} layers, d_model {m['d_model']}, {m['n_head']} heads, "
             f"{m['image_size']}×{m['image_size']} images in {m['patch_size']}×{m['patch_size']} patches "
             f"(8 × 8 = 64 tokens), window {m['window']}, π = 8 (the patches per row); text tower the same size, "
             f"dense, 64 bytes per caption. Batch {args.batch_size}, {args.steps} steps ({pairs:,} image-caption "
             f"pairs, {pairs / 10000:.1f} epochs of 10,000 images), LR 1e-3 → 1e-4, warmup 30, dropout 0, "
             f"{args.threads} thread per run. Test: {EVAL_SIZE:,} images, {5 * EVAL_SIZE:,} captions; mean ± std "
             f"over seeds {', '.join(map(str, args.seeds))}.", "",
             "| image attention | " + " | ".join(KEYS) + " | final train loss | train wall s |",
             "|---|" + "---|" * (len(KEYS) + 2)]
    for kind in args.kinds:
        mine = [r for r in rows if r["attention"] == kind]
        lines.append(f"| {kind} | " + " | ".join(mean_std([r[k] for r in mine]) for k in KEYS)
                     + f" | {mean_std([r['train_loss'] for r in mine])} | "
                     + ", ".join(f"{r['train_seconds']:.0f}" for r in mine) + " |")
    for name, recalls in references.items():
        lines.append(f"| *{name}* | " + " | ".join(f"{recalls[k]:.3f}" for k in KEYS) + " | | |")
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps({"runs": rows, "references": references}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
