"""Small MSCOCO / Flickr30K folders in the Karpathy layout, written by the tests: a JSON and tiny PNG images."""

from __future__ import annotations

import json
import random
from pathlib import Path

from PIL import Image

# Images per JSON split; restval is training data too.
SPLITS = {"train": 5, "restval": 2, "val": 2, "test": 3}
COCO_FOLDERS = ("train2014", "val2014")


def write_karpathy(root: Path, kind: str, seed: int = 0, splits: dict[str, int] = SPLITS,
                   captions: int = 5) -> dict:
    """A `kind` ("coco" or "flickr30k") folder under `root` holding dataset_<kind>.json and one 12 × 10 PNG of
    random colour blocks per entry; entry i has `captions` captions "image <i> caption <j>" (the first
    entry one more, a sixth, as some MSCOCO images have). Returns the JSON written."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    entries = []
    for split, count in splits.items():
        for _ in range(count):
            i = len(entries)
            name = f"img_{i:03d}.png"
            folder = COCO_FOLDERS[i % 2] if kind == "coco" else "flickr30k-images"
            (root / folder).mkdir(exist_ok=True)
            image = Image.new("RGB", (12, 10))
            image.putdata([(rng.randrange(256), rng.randrange(256), rng.randrange(256)) for _ in range(120)])
            image.save(root / folder / name)
            n = captions + (i == 0)
            sentences = [{"raw": f"Image {i} caption {j}.", "tokens": ["image", str(i), "caption", str(j)]}
                         for j in range(n)]
            entry = {"filename": name, "split": split, "sentences": sentences, "imgid": i}
            if kind == "coco":
                entry["filepath"] = folder
            entries.append(entry)
    data = {"images": entries, "dataset": kind}
    (root / f"dataset_{kind}.json").write_text(json.dumps(data))
    return data


def image_file(root: Path, kind: str, entry: dict) -> Path:
    return root / (entry["filepath"] if kind == "coco" else "flickr30k-images") / entry["filename"]
