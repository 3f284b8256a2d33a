"""MSCOCO and Flickr30K in the Karpathy splits, read from the folders the datasets ship in.

    coco:DIR       DIR/dataset_coco.json, images at DIR/<filepath>/<filename> (train2014/, val2014/)
    flickr30k:DIR  DIR/dataset_flickr30k.json, images at DIR/flickr30k-images/<filename>

Each JSON holds `images: [{filename, split, sentences: [{raw, tokens}, ...], ...}]` (COCO entries also
`filepath`), split one of train, val, test, restval. As in the usual protocol "restval" is training data
(MSCOCO: 113,287 training, 5,000 validation and 5,000 test images) and each image keeps its first five
captions (a few MSCOCO images have six or seven). A caption is its lower-case `tokens` joined by spaces
(the datasets' normalised form, no punctuation), or its `raw` text when it has no tokens.

Every problem with the folder (a missing file, a JSON that is not a Karpathy split file, an image listed
but absent or not an image, an image path that is absolute or climbs out with '..') is one ValueError
naming the file, raised when the split is read; damage that only decoding finds (a truncated JPEG) is
reported by `images.load_image` when the file is read.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .images import ImageFiles, check_readable
from .vl import CaptionedImages

JSON_FILES = {"coco": "dataset_coco.json", "flickr30k": "dataset_flickr30k.json"}
# Our split names -> the JSON's.
SPLITS = {"train": ("train", "restval"), "validation": ("val",), "test": ("test",)}
CAPTIONS_PER_IMAGE = 5


def split_file(kind: str, root: str | Path) -> Path:
    """The Karpathy JSON of `kind` ("coco" or "flickr30k") in folder `root`; ValueError naming it if absent."""
    path = Path(root) / JSON_FILES[kind]
    if not path.is_file():
        raise ValueError(f"{path}: no such file (the Karpathy split file of {kind}:{root})")
    return path


def read_entries(path: Path) -> list[dict]:
    """The `images` list of a Karpathy JSON; ValueError naming the file when it is not JSON or has no such list."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a JSON file ({' '.join(str(err).split())})") from None
    images = data.get("images") if isinstance(data, dict) else None
    if not isinstance(images, list):
        raise ValueError(f"{path}: no 'images' list (not a Karpathy split file)")
    return images


def _field(entry, key: str, kind: type, path: Path, index: int):
    value = entry.get(key) if isinstance(entry, dict) else None
    if not isinstance(value, kind):
        raise ValueError(f"{path}: images[{index}] needs {key!r}, a {'string' if kind is str else 'list'}")
    return value


def caption_text(sentence) -> str:
    """The text of one `sentences` entry: its tokens joined by spaces, else its raw text stripped."""
    if not isinstance(sentence, dict):
        return ""
    tokens = sentence.get("tokens")
    if isinstance(tokens, list) and tokens and all(isinstance(t, str) for t in tokens):
        return " ".join(tokens)
    raw = sentence.get("raw")
    return raw.strip() if isinstance(raw, str) else ""


def image_path(folder: Path, parts: list[str], path: Path, index: int) -> Path:
    """`folder` joined with the JSON's `parts` (filepath, filename): ValueError naming the JSON file when a part
    is absolute or holds '..', which would read an image from anywhere (a JSON from elsewhere is data, not
    a path the user chose). Links the user made inside the folder (e.g. to images on another disk) are
    followed as usual."""
    for part in parts:
        if Path(part).is_absolute() or ".." in Path(part).parts:
            raise ValueError(f"{path}: images[{index}] names {part!r}, a path out of {folder}; image paths must "
                             "be relative and stay inside the dataset folder (no '..')")
    return folder.joinpath(*parts)


def read_split(kind: str, root: str | Path, split: str, image_size: int, limit: int | None = None) -> CaptionedImages:
    """The images of `split` ("train" = train + restval, "validation", "test") in file order, at most `limit`,
    decoded on access at `image_size` pixels, with their (first five) captions.

    ValueError naming the file: missing JSON, no `images` list, an entry without filename / split /
    sentences (/ filepath for COCO), an image without captions, a listed image file that does not exist or
    whose header Pillow cannot read (`images.check_readable`), a split without images.
    """
    path = split_file(kind, root)
    folder = path.parent
    paths, captions, caption_image = [], [], []
    for index, entry in enumerate(read_entries(path)):
        if limit is not None and len(paths) == limit:
            break
        if _field(entry, "split", str, path, index) not in SPLITS[split]:
            continue
        name = _field(entry, "filename", str, path, index)
        image = (image_path(folder, [_field(entry, "filepath", str, path, index), name], path, index)
                 if kind == "coco" else image_path(folder, ["flickr30k-images", name], path, index))
        texts = [t for t in map(caption_text, _field(entry, "sentences", list, path, index)) if t]
        if not texts:
            raise ValueError(f"{path}: images[{index}] ({name}) has no caption")
        if not image.is_file():
            raise ValueError(f"{image}: no such image file (listed in {path})")
        captions += texts[:CAPTIONS_PER_IMAGE]
        caption_image += [len(paths)] * min(len(texts), CAPTIONS_PER_IMAGE)
        paths.append(image)
    if not paths:
        raise ValueError(f"{path}: no image in the {split} split (JSON split {' / '.join(SPLITS[split])})")
    check_readable(paths)
    return CaptionedImages(ImageFiles(paths, image_size), captions, torch.tensor(caption_image, dtype=torch.int64))
