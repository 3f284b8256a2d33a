"""Captioned-image data: the generated shapes, image decoding, the Karpathy readers, the training loader."""

from __future__ import annotations

import sys
from collections import deque

import numpy as np
import pytest
import torch
from PIL import Image

from karpathy_folders import image_file, write_karpathy
from piattn.data import karpathy, shapes
from piattn.data.images import MEAN, STD, ImageFiles, ImageTensor, load_image, normalize, pillow
from piattn.data.retrieval import encode_text
from piattn.data.vl import CaptionedImages, CaptionLoader, encode_captions, parse_source


def components(image: np.ndarray) -> list[list[tuple[int, int]]]:
    """The 4-connected groups of non-black pixels of image [S, S, 3]: (y, x) lists."""
    size = image.shape[0]
    seen = np.zeros((size, size), dtype=bool)
    groups = []
    for start in zip(*np.nonzero(image.any(-1)), strict=True):
        if seen[start]:
            continue
        seen[start], queue, group = True, deque([start]), []
        while queue:
            y, x = queue.popleft()
            group.append((y, x))
            for ny, nx in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                if 0 <= ny < size and 0 <= nx < size and not seen[ny, nx] and image[ny, nx].any():
                    seen[ny, nx] = True
                    queue.append((ny, nx))
        groups.append(group)
    return groups


def describe(image: np.ndarray, group: list[tuple[int, int]]) -> tuple[str, np.ndarray]:
    """("colour shape", bounding-box centre (x, y)) of one object, read from its pixels only."""
    ys, xs = np.array(group).T
    (colour,) = {name for name, rgb in shapes.COLOURS.items() if (image[ys[0], xs[0]] == rgb).all()}
    fill = len(group) / ((np.ptp(ys) + 1) * (np.ptp(xs) + 1))  # square ~1, circle ~π/4, triangle ~1/2
    shape = "square" if fill > 0.92 else "circle" if fill > 0.66 else "triangle"
    return f"{colour} {shape}", np.array([(xs.min() + xs.max() + 1) / 2, (ys.min() + ys.max() + 1) / 2])


def test_shapes_captions_describe_the_pixels():
    size = 32
    data = shapes.generate(60, seed=5, size=size)
    images = data.images.batch(torch.arange(60)).permute(0, 2, 3, 1).numpy()
    assert data.caption_image.tolist() == [i // 5 for i in range(300)]
    relations = set()
    for i, image in enumerate(images):
        groups = components(image)
        assert len(groups) == 2  # two objects, apart
        (a, ca), (b, cb) = (describe(image, g) for g in groups)
        assert a != b
        along, across = sorted(abs(ca - cb))[::-1]
        assert along >= size / 2 - 1 and across <= along / 2 + 1  # far apart along one axis
        rel = shapes.relation(ca, cb)
        expected = {rel: shapes.captions(a, b, rel), shapes.INVERSE[rel]: shapes.captions(b, a, shapes.INVERSE[rel])}
        (stated,) = [r for r, texts in expected.items() if texts == data.captions[5 * i:5 * i + 5]]
        relations.add(stated)
    assert relations == set(shapes.INVERSE)  # every relation is stated by some first caption


def test_shapes_are_deterministic_from_the_seed():
    a, b, c = shapes.generate(20, 3, 24), shapes.generate(20, 3, 24), shapes.generate(20, 4, 24)
    assert torch.equal(a.images.images, b.images.images) and a.captions == b.captions
    assert not torch.equal(a.images.images, c.images.images)
    assert a.images.images.shape == (20, 3, 24, 24) and a.images.images.dtype == torch.uint8


def test_a_relation_caption_names_the_object_above_first():
    assert shapes.relation(np.array([5.0, 2.0]), np.array([6.0, 20.0])) == "above"
    assert shapes.relation(np.array([25.0, 9.0]), np.array([3.0, 12.0])) == "to the right of"
    assert shapes.captions("red circle", "blue square", "above")[1] == "a blue square below a red circle"


def write_png(path, pixels: np.ndarray) -> None:
    Image.fromarray(pixels.astype(np.uint8), "RGB").save(path)


def test_load_image_resizes_the_shorter_side_and_keeps_the_centre(tmp_path):
    wide = np.zeros((20, 80, 3))
    wide[:, :20] = (255, 0, 0)
    wide[:, 20:60] = (0, 255, 0)
    wide[:, 60:] = (0, 0, 255)
    write_png(tmp_path / "wide.png", wide)
    image = load_image(tmp_path / "wide.png", 10)  # 80 × 20 -> 40 × 10 -> columns 15 … 24
    assert image.shape == (3, 10, 10) and image.dtype == torch.uint8
    assert (image[0] <= 1).all() and (image[1] >= 254).all() and (image[2] <= 1).all()

    square = np.random.default_rng(0).integers(0, 256, (8, 8, 3))
    write_png(tmp_path / "square.png", square)
    assert torch.equal(load_image(tmp_path / "square.png", 8), torch.from_numpy(square).permute(2, 0, 1).byte())


def test_image_files_decode_in_index_order(tmp_path):
    for i in range(3):
        write_png(tmp_path / f"{i}.png", np.full((4, 4, 3), 10 * i))
    files = ImageFiles([tmp_path / f"{i}.png" for i in range(3)], 4)
    assert len(files) == 3
    assert files.batch(torch.tensor([2, 0, 1]))[:, 0, 0, 0].tolist() == [20, 0, 10]


def test_image_errors_name_the_file(tmp_path):
    with pytest.raises(ValueError, match=f"^{tmp_path / 'absent.png'}: no such image file$"):
        load_image(tmp_path / "absent.png", 8)
    (tmp_path / "bad.png").write_bytes(b"not a picture")
    with pytest.raises(ValueError, match=f"^{tmp_path / 'bad.png'}: not a readable image"):
        load_image(tmp_path / "bad.png", 8)


def test_without_pillow_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "PIL", None)
    with pytest.raises(ValueError, match=r"pip install piattn\[vision\]") as err:
        pillow()
    assert isinstance(err.value, ImportError) and "\n" not in str(err.value)


def test_normalize_uses_the_channel_statistics():
    white = torch.full((1, 3, 2, 2), 255, dtype=torch.uint8)
    out = normalize(white)
    assert out.dtype == torch.float32
    expected = torch.tensor([(1 - m) / s for m, s in zip(MEAN, STD, strict=True)])
    assert torch.allclose(out[0, :, 1, 1], expected)


@pytest.mark.parametrize("kind", ["coco", "flickr30k"])
def test_karpathy_splits(tmp_path, kind):
    data = write_karpathy(tmp_path, kind)
    entries = data["images"]
    train = karpathy.read_split(kind, tmp_path, "train", 8)
    # train + restval, in file order; the first entry's sixth caption is dropped
    expected = [e for e in entries if e["split"] in ("train", "restval")]
    assert train.images.paths == [image_file(tmp_path, kind, e) for e in expected]
    assert len(train.captions) == 5 * len(expected) and train.captions[:2] == ["image 0 caption 0", "image 0 caption 1"]
    assert train.caption_image.tolist() == [i // 5 for i in range(5 * len(expected))]
    test = karpathy.read_split(kind, tmp_path, "test", 8)
    assert [p.name for p in test.images.paths] == [e["filename"] for e in entries if e["split"] == "test"]
    assert len(karpathy.read_split(kind, tmp_path, "validation", 8).images) == 2
    assert len(karpathy.read_split(kind, tmp_path, "train", 8, limit=3).images) == 3
    assert test.images.batch(torch.tensor([0])).shape == (1, 3, 8, 8)


def test_a_caption_without_tokens_is_its_raw_text():
    assert karpathy.caption_text({"raw": " A dog runs. ", "tokens": []}) == "A dog runs."
    assert karpathy.caption_text({"raw": "A dog.", "tokens": ["a", "dog"]}) == "a dog"


def test_parse_source():
    assert parse_source(None) == ("shapes", None) == parse_source("shapes")
    kind, folder = parse_source("flickr30k:/data/f30k")
    assert kind == "flickr30k" and str(folder) == "/data/f30k"
    for bad in ("coco", "coco:", "imagenet:/x", "/data/coco"):
        with pytest.raises(ValueError, match="must be shapes, coco:DIR or flickr30k:DIR"):
            parse_source(bad)


def test_encode_captions_bytes_plus_one_padded():
    ids = encode_captions(["ab", "é"], 4)
    assert ids.tolist() == [[98, 99, 0, 0], [0xC3 + 1, 0xA9 + 1, 0, 0]]


def captioned(counts: list[int]) -> tuple[CaptionedImages, torch.Tensor]:
    """Images 0 … n-1 whose pixel [0, 0, 0] is the image index; caption ids [image, caption number]."""
    n = len(counts)
    images = ImageTensor(torch.arange(n, dtype=torch.uint8).view(n, 1, 1, 1).expand(n, 3, 8, 8).clone())
    caption_image = torch.arange(n).repeat_interleave(torch.tensor(counts))
    ids = torch.stack([caption_image, torch.cat([torch.arange(c) for c in counts])], 1)
    return CaptionedImages(images, [str(i) for i in range(len(ids))], caption_image), ids


def test_caption_loader_shows_each_image_once_per_epoch_with_its_captions_in_turn():
    data, ids = captioned([5, 5, 3, 5, 1, 5])
    loader = CaptionLoader(data, ids, batch_size=3, seed=1)
    assert loader.batches_per_epoch == 2
    for epoch in range(3):
        seen = []
        for _ in range(2):
            images, captions = loader.next_batch()
            image_index = images[:, 0, 0, 0].long()
            assert torch.equal(captions[:, 0], image_index)  # each caption is its image's
            counts = data.captions_per_image[image_index]
            assert torch.equal(captions[:, 1], (epoch + image_index) % counts)
            seen += image_index.tolist()
        assert sorted(seen) == list(range(6))


def test_caption_loader_resumes_where_it_stopped():
    data, ids = captioned([5] * 7)
    straight = CaptionLoader(data, ids, batch_size=2, seed=3)
    batches = [straight.next_batch() for _ in range(8)]
    first = CaptionLoader(data, ids, batch_size=2, seed=3)
    for _ in range(5):
        first.next_batch()
    resumed = CaptionLoader(data, ids, batch_size=2, seed=3)
    resumed.load_state_dict(first.state_dict())
    for expected in batches[5:]:
        got = resumed.next_batch()
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_captions_must_be_grouped_by_image():
    images = ImageTensor(torch.zeros(2, 3, 8, 8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="grouped by image"):
        CaptionedImages(images, ["a", "b", "c"], torch.tensor([0, 1, 0]))
    with pytest.raises(ValueError, match="image 1 has no caption"):
        CaptionedImages(images, ["a"], torch.tensor([0]))


def test_encode_captions_gives_the_ids_of_the_byte_encoder():
    texts = ["a dog", "ÿ" * 3, "x" * 40, ""]
    assert torch.equal(encode_captions(texts, 16).long(), torch.stack([encode_text(t, 16) for t in texts]))
