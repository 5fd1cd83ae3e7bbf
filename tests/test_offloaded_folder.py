"""`OffloadedCache(folder=...)` makes its folder when something first spills there, never before; a folder that
could not be made is still refused at construction."""

import pytest
import torch

from hf_kvplus import OffloadedCache
from hf_kvplus.errors import DiskTierError
from hf_kvplus.transformers_compat import cache_kwargs

pytestmark = pytest.mark.usefixtures("on_cpu")


@pytest.fixture(scope="module")
def model(tiny_llama):
    return tiny_llama


def fill(model, cache) -> None:
    with torch.no_grad():
        model(torch.arange(1, 17)[None], **cache_kwargs(cache), use_cache=True)


def test_nothing_is_made_on_disk_until_a_layer_spills(model, tmp_path):
    folder = tmp_path / "scratch" / "kv"
    roomy = OffloadedCache(model.config, host_budget=1 << 30, folder=folder)
    fill(model, roomy)
    assert roomy.tier_bytes().disk == 0 and "scratch" in repr(roomy.placement)
    assert not (tmp_path / "scratch").exists(), "a cache that never spilled made its folder"

    tight = OffloadedCache(model.config, host_budget=0, folder=folder)
    assert not folder.exists()
    fill(model, tight)
    files = tight.placement.disk.files()
    assert tight.tier_bytes().disk > 0 and files and all(f.parent.parent == folder for f in files)


def test_a_folder_that_cannot_be_made_is_refused_at_construction(model, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(DiskTierError, match=r"a-file/kv/deeper is not usable: .*a-file is not a writable folder"):
        OffloadedCache(model.config, host_budget=0, folder=blocker / "kv" / "deeper")
