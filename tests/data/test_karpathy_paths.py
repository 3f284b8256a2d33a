"""A Karpathy split JSON names image files; it may not name files outside the dataset folder.

The JSON usually comes from elsewhere (a download), so its `filepath` / `filename` are data: an absolute
path or a '..' would make training and `piattn eval` read (and show, as a retrieval result) any image on
the machine. Each case places a readable image outside the folder, so that reading it would succeed.
"""

from __future__ import annotations

import json
import shutil

import pytest

from karpathy_folders import image_file, write_karpathy
from piattn.data import karpathy


def aim_first_test_image(root, kind, field, value):
    """Point the first test entry's `field` at `value`; returns that entry's index."""
    file = root / karpathy.JSON_FILES[kind]
    data = json.loads(file.read_text())
    index = next(i for i, e in enumerate(data["images"]) if e["split"] == "test")
    data["images"][index][field] = value
    file.write_text(json.dumps(data))
    return index


def outside_image(root, kind, tmp_path):
    """A copy of one of the folder's images, outside the folder: tmp_path/outside/secret.png."""
    data = json.loads((root / karpathy.JSON_FILES[kind]).read_text())
    (tmp_path / "outside").mkdir()
    return shutil.copy(image_file(root, kind, data["images"][0]), tmp_path / "outside" / "secret.png")


@pytest.mark.parametrize(("kind", "field", "value"), [
    ("flickr30k", "filename", "../../outside/secret.png"),
    ("flickr30k", "filename", "{secret}"),
    ("coco", "filepath", "../outside"),
    ("coco", "filepath", "{outside}"),
    ("coco", "filename", "../../outside/secret.png"),
])
def test_an_image_path_out_of_the_folder_is_refused(tmp_path, kind, field, value):
    root = tmp_path / "data"
    write_karpathy(root, kind)
    secret = outside_image(root, kind, tmp_path)
    value = value.format(secret=secret, outside=secret.parent)
    if field == "filepath":
        aim_first_test_image(root, kind, "filename", "secret.png")
    index = aim_first_test_image(root, kind, field, value)
    with pytest.raises(ValueError) as err:
        karpathy.read_split(kind, root, "test", image_size=8)
    message = str(err.value)
    assert message.startswith(f"{root / karpathy.JSON_FILES[kind]}: images[{index}] names {value!r}")
    assert "stay inside the dataset folder" in message and "\n" not in message


def test_nested_relative_paths_and_links_the_user_made_still_work(tmp_path):
    root = tmp_path / "data"
    data = write_karpathy(root, "coco")
    # images on another disk, linked into the folder by the user: followed as before
    shutil.move(root / "val2014", tmp_path / "elsewhere")
    (root / "val2014").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (root / "train2014" / "sub").mkdir()
    first_test = next(e for e in data["images"] if e["split"] == "test")
    shutil.move(image_file(root, "coco", first_test), root / "train2014" / "sub" / first_test["filename"])
    aim_first_test_image(root, "coco", "filepath", "train2014/sub")
    split = karpathy.read_split("coco", root, "test", image_size=8)
    assert len(split.images) == 3
