"""The AR's host KV cache onto transparent huge pages (omni_runtime/kv/huge_pages.py): what a
receiver's NIXL READ of it pins is 2 MiB pages, not 4 KiB ones (docs/connector.md). Where the
kernel or its settings cannot do it (no THP, THP off, no MADV_COLLAPSE), the outcome must say
so and claim nothing; on this project's machines (Linux 6.1+, THP in madvise mode) the range
is moved and /proc/self/smaps agrees."""

from __future__ import annotations

import ctypes
import mmap

import pytest
import torch

from omni_runtime.kv.huge_pages import collapse_into_huge_pages, huge_page_bytes, huge_page_size


def test_a_populated_range_moves_onto_huge_pages_with_its_bytes_unchanged():
    size = huge_page_size()
    cache = torch.arange(12 << 18, dtype=torch.float32)  # 12 MiB, written: populated pages
    before = cache.clone()
    nbytes = cache.numel() * 4
    outcome = collapse_into_huge_pages(cache.data_ptr(), nbytes)
    assert torch.equal(cache, before)
    if outcome.unsupported:  # this kernel or its settings: nothing moved, and it says why
        assert outcome.bytes == 0 and outcome.why_not
        return
    assert size and outcome.why_not == "" and outcome.bytes >= nbytes - 2 * size
    assert outcome.bytes % size == 0 and outcome.seconds > 0
    assert huge_page_bytes([(cache.data_ptr(), nbytes)]) >= outcome.bytes


def test_a_range_without_a_whole_huge_page_or_unmapped_is_left_alone_and_nothing_raises():
    small = torch.zeros(1 << 18, dtype=torch.uint8)  # 256 KiB
    outcome = collapse_into_huge_pages(small.data_ptr(), small.numel())
    assert outcome.bytes == 0 and outcome.why_not
    # A range this process had mapped and gave back: an error code, never an exception.
    gone = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = ctypes.c_char.from_buffer(gone)
    addr = ctypes.addressof(view)
    del view  # the buffer's export, before the mapping is closed
    gone.close()
    unmapped = collapse_into_huge_pages(addr, 64 << 20)
    assert unmapped.bytes == 0 and unmapped.why_not


def test_a_malformed_host_huge_pages_setting_refuses_the_connector_naming_the_key():
    from omni_runtime.devtools.sched_harness import make_vllm_config
    from omni_runtime.kv.connector_config import ConnectorConfigError
    from omni_runtime.kv.worker_side import OmniKVConnectorWorker

    config = make_vllm_config({"need_send_cache": True})
    config.kv_transfer_config.kv_connector_extra_config["host_huge_pages"] = "yes"
    with pytest.raises(ConnectorConfigError, match="kv_connector_extra_config.host_huge_pages must be true or false"):
        OmniKVConnectorWorker(config)
    config.kv_transfer_config.kv_connector_extra_config["host_huge_pages"] = False
    assert OmniKVConnectorWorker(config)._host_huge_pages is False
