"""`piattn train --task vl-retrieval` then `piattn eval`, end to end on tiny Karpathy folders and on shapes.

Recalls from `piattn eval` are checked against an oracle written here: the checkpoint loaded into a bare
`DualEncoder`, the test split rebuilt from the files (or the generator), and Recall@K counted by sorting,
one query at a time. The ranking itself is checked against a similarity matrix and recalls worked out by
hand.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

from karpathy_folders import image_file, write_karpathy
from piattn.cli import main
from piattn.commands.train import add_arguments, train_config
from piattn.config import TrainConfig
from piattn.config.vision import VisionLanguageConfig
from piattn.data import shapes
from piattn.data.images import load_image, normalize
from piattn.data.vl import encode_captions
from piattn.models import DualEncoder
from piattn.tasks.ranking import retrieval_recalls
from piattn.train.checkpoint import load_weights, read_config, read_latest
from piattn.train.metrics import read_metrics
from utils import train_summary

TINY = ["--n-layer", "1", "--d-model", "16", "--n-head", "2", "--caption-len", "24", "--warmup", "1",
        "--device", "cpu", "--precision", "fp32", "--no-progress"]
KEYS = ("i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10")


def test_recalls_by_hand():
    # 3 images, 5 captions: image 0 has captions 0, 1; image 1 caption 2; image 2 captions 3, 4
    caption_image = torch.tensor([0, 0, 1, 2, 2])
    similarity = torch.tensor([[0.9, 0.1, 0.8, 0.3, 0.2],
                               [0.5, 0.7, 0.6, 0.2, 0.9],
                               [0.4, 0.3, 0.1, 0.2, 0.4]], dtype=torch.float64)
    # image → text, 0-based rank = wrong captions scoring >= the image's best caption:
    #   image 0: best 0.9, none above -> 0; image 1: 0.6, beaten by 0.7 and 0.9 -> 2;
    #   image 2: best 0.4 (caption 4), tied by caption 0 (a tie counts against) -> 1
    # text → image, rank = other images scoring >= the caption's own image:
    #   caption 0: 0.9 top -> 0; caption 1: 0.1 < 0.7, 0.3 -> 2; caption 2: 0.6 < 0.8 -> 1;
    #   caption 3: 0.2 < 0.3, tied by image 1 -> 2; caption 4: 0.4 < 0.9 -> 1
    expected = {"i2t_r1": 1 / 3, "i2t_r2": 2 / 3, "i2t_r3": 1.0, "t2i_r1": 1 / 5, "t2i_r2": 3 / 5, "t2i_r3": 1.0}
    # caption embeddings = identity, so image_emb @ caption_emb.T is the matrix itself; chunks of 2 rows
    got = retrieval_recalls(similarity, torch.eye(5, dtype=torch.float64), caption_image, ks=(1, 2, 3), chunk=2)
    assert got == pytest.approx(expected, abs=1e-15)
    assert tuple(retrieval_recalls(similarity, torch.eye(5, dtype=torch.float64), caption_image)) == KEYS


def test_a_collapsed_model_scores_zero():
    """All embeddings equal: every candidate ties, and ties count against the query."""
    ones = torch.ones(4, 3)
    got = retrieval_recalls(ones, torch.ones(8, 3), torch.arange(4).repeat_interleave(2), ks=(1, 2))
    assert got == {"i2t_r1": 0.0, "i2t_r2": 0.0, "t2i_r1": 0.0, "t2i_r2": 0.0}


def oracle_recalls(similarity: torch.Tensor, caption_image: list[int]) -> dict[str, float]:
    """Recall@1/5/10 by sorting each query's candidates, ties put wrong-first (the protocol)."""
    n_images, n_captions = similarity.shape
    result = {}
    for k in (1, 5, 10):
        hits = 0
        for i in range(n_images):
            order = sorted(range(n_captions), key=lambda j: (-similarity[i, j].item(), caption_image[j] == i))
            hits += any(caption_image[j] == i for j in order[:k])
        result[f"i2t_r{k}"] = hits / n_images
        hits = 0
        for j in range(n_captions):
            order = sorted(range(n_images), key=lambda i: (-similarity[i, j].item(), i == caption_image[j]))
            hits += caption_image[j] in order[:k]
        result[f"t2i_r{k}"] = hits / n_captions
    return result


def checkpoint_model(out) -> DualEncoder:
    folder = read_latest(out / "checkpoints")
    model = DualEncoder(VisionLanguageConfig.from_dict(read_config(folder)["model"]))
    load_weights(model, folder)
    return model.eval()


def train_then_eval(capsys, out, *argv) -> tuple[dict, dict]:
    assert main(["train", "--task", "vl-retrieval", "--out", str(out), "--steps", "2", "--eval-every", "2",
                 "--log-every", "1", *TINY, *argv]) == 0
    summary = train_summary(out, capsys)
    assert main(["eval", "--checkpoint", str(out), "--use-stored-data", "--split", "test", "--device", "cpu",
                 "--json"]) == 0
    return summary, json.loads(capsys.readouterr().out)


def assert_recalls(result: dict, model: DualEncoder, images: torch.Tensor, captions: list[str],
                   caption_image: list[int]) -> None:
    """images uint8 [N, 3, S, S]: the eval JSON holds the oracle's recalls of this split."""
    with torch.no_grad():
        similarity = model.encode_images(normalize(images)) @ \
            model.encode_texts(encode_captions(captions, model.config.caption_len).long()).T
    assert (result["images"], result["captions"]) == (len(images), len(captions))
    assert all(0.0 <= result[k] <= 1.0 for k in KEYS)
    assert {k: result[k] for k in KEYS} == pytest.approx(oracle_recalls(similarity, caption_image), abs=1e-12)


@pytest.mark.parametrize("kind", ["coco", "flickr30k"])
def test_karpathy_folder_end_to_end(tmp_path, capsys, kind):
    data = write_karpathy(tmp_path / kind, kind)
    out = tmp_path / "run"
    summary, result = train_then_eval(capsys, out, "--data", f"{kind}:{tmp_path / kind}", "--image-size", "8",
                                      "--patch-size", "4", "--batch-size", "4", "--attention", "pi")
    assert summary["step"] == 2 and summary["validation"]["images"] == 2
    assert result["split"] == "test" and result["data"] == f"{kind}:{tmp_path / kind}"
    first = next(r for r in read_metrics(out) if r["split"] == "train")
    assert first["tokens"] == 4 * (2 * 2 + 24)  # patches + caption ids per example

    test = [e for e in data["images"] if e["split"] == "test"]
    images = torch.stack([load_image(image_file(tmp_path / kind, kind, e), 8) for e in test])
    captions = [" ".join(s["tokens"]) for e in test for s in e["sentences"][:5]]
    model = checkpoint_model(out)
    assert model.config.period == 2  # the patches per row
    assert_recalls(result, model, images, captions, [i // 5 for i in range(len(captions))])


def test_shapes_end_to_end(tmp_path, capsys):
    out = tmp_path / "run"
    summary, result = train_then_eval(capsys, out, "--data", "shapes", "--image-size", "16", "--train-size", "8",
                                      "--eval-size", "6", "--batch-size", "4", "--eval-batches", "1",
                                      "--data-seed", "1", "--attention", "local", "--window", "2")
    assert summary["validation"]["images"] == 4 and summary["validation"]["captions"] == 20  # one batch
    assert read_config(read_latest(out / "checkpoints"))["train_args"]["seq_len"] == 16  # (16 / 4)² patches
    test = shapes.generate(6, seed=3 * 1 + 2, size=16)
    assert_recalls(result, checkpoint_model(out), test.images.images, test.captions, test.caption_image.tolist())


def test_a_stopped_run_resumes_exactly(tmp_path):
    def config(out, *extra) -> TrainConfig:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        return TrainConfig.from_args(parser.parse_args([
            "--task", "vl-retrieval", "--image-size", "16", "--train-size", "12", "--eval-size", "4",
            "--batch-size", "4", "--steps", "8", "--eval-every", "0", "--log-every", "1", "--save-every", "0",
            "--dropout", "0.1", "--out", str(out), *TINY, *extra]))

    def losses(out):
        return [(r["step"], r["loss"]) for r in read_metrics(out) if r["split"] == "train"]

    def stop_at(step, micro):
        if step == 4:  # three batches per epoch: the resumed run starts in the second epoch
            raise KeyboardInterrupt

    train_config(config(tmp_path / "straight"))
    with pytest.raises(KeyboardInterrupt):
        train_config(config(tmp_path / "stopped"), on_micro_step=stop_at)
    train_config(config(tmp_path / "stopped", "--resume"))
    assert losses(tmp_path / "stopped") == losses(tmp_path / "straight")
    assert [step for step, _ in losses(tmp_path / "straight")] == list(range(1, 9))


def one_error_line(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"piattn {command}: error: "), err
    return err[0]


def corrupt(path):
    path.write_bytes(b"<html>not found</html>")


def damage(root, data: dict, how: str):
    """Break the COCO folder `root` (written as `data`) as `how` says; returns the file the error must name."""
    json_file, image = root / "dataset_coco.json", image_file(root, "coco", data["images"][3])  # a training image
    if how == "missing-json":
        json_file.unlink()
    elif how == "json-without-images":
        json_file.write_text(json.dumps({"annotations": []}))
    elif how == "missing-image":
        image.unlink()
    else:
        corrupt(image)
    return json_file if "json" in how else image


@pytest.mark.parametrize(("how", "message"), [
    ("missing-json", "no such file (the Karpathy split file of coco:"),
    ("json-without-images", "no 'images' list (not a Karpathy split file)"),
    ("missing-image", "no such image file (listed in"),
    ("unreadable-image", "not a readable image (cannot identify image file"),
])
def test_bad_folders_are_one_line_naming_the_file(tmp_path, capsys, how, message):
    root = tmp_path / "coco"
    named = damage(root, write_karpathy(root, "coco"), how)
    argv = ["train", "--task", "vl-retrieval", "--data", f"coco:{root}", "--image-size", "8", "--patch-size", "4",
            "--batch-size", "2", "--steps", "1", "--out", str(tmp_path / "run"), *TINY]
    assert main(argv) == 2
    assert one_error_line(capsys, "train").startswith(f"piattn train: error: {named}: {message}")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_an_unreadable_test_image_stops_eval_with_one_line(tmp_path, capsys):
    root = tmp_path / "f30k"
    data = write_karpathy(root, "flickr30k")
    out = tmp_path / "run"
    assert main(["train", "--task", "vl-retrieval", "--data", f"flickr30k:{root}", "--image-size", "8",
                 "--patch-size", "4", "--batch-size", "2", "--steps", "1", "--eval-every", "0", "--out", str(out),
                 *TINY]) == 0
    bad = image_file(root, "flickr30k", data["images"][-1])
    corrupt(bad)
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(out), "--use-stored-data", "--split", "test", "--device", "cpu"]) == 2
    assert f"{bad}: not a readable image" in one_error_line(capsys, "eval")


@pytest.mark.parametrize(("argv", "message"), [
    (["--data", "imagenet:/data"], "--data: vision-language data must be shapes, coco:DIR or flickr30k:DIR, "
                                   "got 'imagenet:/data'"),
    (["--image-size", "18"], "--image-size (18) must be a multiple of --patch-size (4)"),
    (["--seq-len", "10"], "--seq-len must be (--image-size / --patch-size)² = 64 for --task vl-retrieval"),
])
def test_bad_flags_are_one_line(tmp_path, capsys, argv, message):
    assert main(["train", "--task", "vl-retrieval", "--out", str(tmp_path / "run"), *TINY, *argv]) == 2
    assert message in one_error_line(capsys, "train")


def test_vl_flags_apply_to_vl_retrieval_only(tmp_path, capsys):
    assert main(["train", "--task", "reach", "--lag", "2", "--patch-size", "4", "--out", str(tmp_path), *TINY]) == 2
    assert "--patch-size applies to --task vl-retrieval only, not 'reach'" in one_error_line(capsys, "train")


def test_without_pillow_a_folder_is_refused_with_the_install_line(tmp_path, capsys, monkeypatch):
    root = tmp_path / "coco"
    write_karpathy(root, "coco")
    monkeypatch.setitem(sys.modules, "PIL", None)
    assert main(["train", "--task", "vl-retrieval", "--data", f"coco:{root}", "--out", str(tmp_path / "run"),
                 *TINY]) == 2
    assert "pip install piattn[vision]" in one_error_line(capsys, "train")


def test_importing_piattn_needs_no_pillow():
    """A fresh interpreter in which `import PIL` fails imports the package, the task and the shapes data."""
    code = ("import sys; sys.modules['PIL'] = None\n"
            "import piattn, piattn.tasks, piattn.data.karpathy, piattn.models\n"
            "from piattn.data import shapes; shapes.generate(2, 0, 16)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={"PYTHONPATH": ":".join(sys.path), "PATH": ""})
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")
@pytest.mark.slow  # two processes, as test_ddp.py for the language model
def test_two_processes_train_and_validate(tmp_path):
    """torchrun, 2 CPU ranks: each trains on its half of the images; validation ranks the whole split."""
    out = tmp_path / "ddp"
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
              "piattn.cli", "train", "--task", "vl-retrieval", "--image-size", "16", "--train-size", "8",
              "--eval-size", "6", "--batch-size", "2", "--steps", "2", "--eval-every", "2", "--eval-batches", "0",
              "--log-every", "1", "--out", str(out), *TINY]
    done = subprocess.run(launch, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (validation,) = [r for r in read_metrics(out) if r["split"] == "validation"]
    assert (validation["images"], validation["captions"]) == (6, 30)
    assert read_latest(out / "checkpoints").name == "step_00000002"
