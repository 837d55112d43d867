"""weft-hisparse's page state machine, resolver and speculative top-k layout, driven directly."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("weft_hisparse")

from weft_hisparse.pages import HotBuffer, PagePlanner, PageState  # noqa: E402
from weft_hisparse.topk import per_step_slots  # noqa: E402


def states(planner: PagePlanner, request_id: str) -> list[str]:
    return [page.state.value for page in planner.pages[request_id]]


def test_the_watermark_is_the_hot_buffer_or_a_tenth_of_the_blocks():
    assert PagePlanner(num_blocks=100, hot_buffer_blocks=4, host_rows=8, workers=1).transition_watermark == 10
    assert PagePlanner(num_blocks=100, hot_buffer_blocks=16, host_rows=8, workers=1).transition_watermark == 16


def test_a_page_is_clean_only_after_every_worker_acknowledged_its_copy():
    planner = PagePlanner(num_blocks=100, hot_buffer_blocks=2, host_rows=8, workers=2)
    planner.add_pages("r", [10, 11, 12])
    plan = planner.plan(free_gpu_blocks=50)
    assert [(copy.page, copy.gpu_block) for copy in plan.copies] == [(0, 10), (1, 11), (2, 12)]
    assert plan.unpinned == ()
    assert planner.plan(free_gpu_blocks=50).copies == ()  # planned once
    planner.acknowledge(0, plan.copies)
    assert states(planner, "r") == ["dirty"] * 3 and planner.durable_prefix("r") == 0
    planner.acknowledge(1, plan.copies[1:])
    assert states(planner, "r") == ["dirty", "clean", "clean"]
    assert planner.durable_prefix("r") == 0  # only the contiguous prefix is durable
    planner.acknowledge(1, plan.copies[:1])
    assert planner.durable_prefix("r") == 3


def test_below_the_watermark_clean_pages_unpin_tail_first_keeping_the_last():
    planner = PagePlanner(num_blocks=100, hot_buffer_blocks=2, host_rows=8, workers=1, keep_tail=2)
    planner.add_pages("r", [20, 21, 22, 23, 24, 25])
    planner.acknowledge(0, planner.plan(free_gpu_blocks=50).copies)
    assert planner.plan(free_gpu_blocks=50).unpinned == ()  # above the watermark: pinned
    plan = planner.plan(free_gpu_blocks=8)  # two short of the watermark of 10
    assert plan.unpinned == (23, 22)
    assert states(planner, "r") == ["clean", "clean", "unpinned", "unpinned", "clean", "clean"]
    assert planner.plan(free_gpu_blocks=0).unpinned == (21, 20)  # never the last two


def test_admitted_prefills_demand_unpins_beyond_the_watermark_and_dirty_or_tail_pages_stay_pinned():
    planner = PagePlanner(num_blocks=100, hot_buffer_blocks=2, host_rows=8, workers=1, keep_tail=2)
    planner.add_pages("r", [20, 21, 22, 23, 24, 25])
    assert planner.pinned("r") == 6  # dirty: nothing can be lent yet
    planner.acknowledge(0, planner.plan(free_gpu_blocks=50).copies)
    assert planner.pinned("r") == 2  # clean: all but the last two can be lent
    assert planner.plan(free_gpu_blocks=10).unpinned == ()  # at the watermark and nothing asked for
    assert planner.plan(free_gpu_blocks=10, demand=3).unpinned == (23, 22, 21)  # a prefill is to take three more
    assert planner.pinned("r") == 2


def test_a_reused_unpinned_page_is_read_from_the_host():
    planner = PagePlanner(num_blocks=10, hot_buffer_blocks=3, host_rows=8, workers=1, keep_tail=1)
    planner.add_pages("r", [1, 2, 3])
    planner.acknowledge(0, planner.plan(free_gpu_blocks=9).copies)
    assert planner.plan(free_gpu_blocks=0).unpinned == (2, 1)
    buffer = HotBuffer(rows=1)
    pages = planner.pages["r"]
    # Unpinned but not reused: still read on the GPU.
    assert [(loc.kind, loc.index) for loc in buffer.resolve(pages, [0, 1, 2])] == [("gpu", 1), ("gpu", 2), ("gpu", 3)]
    planner.reused(1)
    host_row = pages[0].host_row
    first = buffer.resolve(pages, [0, 2])
    assert [(loc.kind, loc.index, loc.hot_row) for loc in first] == [("host", host_row, 0), ("gpu", 3, -1)]
    assert [(loc.kind, loc.index) for loc in buffer.resolve(pages, [0])] == [("hot", 0)]  # copied in last step
    planner.reused(2)
    # One hot row: page 1 evicts page 0 (least recently used), then page 0 comes back from the host.
    assert [loc.kind for loc in buffer.resolve(pages, [1])] == ["host"]
    assert [loc.kind for loc in buffer.resolve(pages, [0])] == ["host"]
    assert pages[0].state is PageState.UNPINNED


def test_a_preempted_request_s_planned_copies_are_dropped_not_published():
    planner = PagePlanner(num_blocks=100, hot_buffer_blocks=2, host_rows=3, workers=2)
    planner.add_pages("r", [5, 6])
    plan = planner.plan(free_gpu_blocks=50)
    assert len(plan.copies) == 2 and planner.free_host_rows == [2]
    assert sorted(planner.release("r")) == [5, 6]  # preempted: still pinned blocks go back to the engine
    assert sorted(planner.free_host_rows) == [0, 1, 2]
    for worker in (0, 1):
        planner.acknowledge(worker, plan.copies)  # late acknowledgements change nothing
    assert "r" not in planner.pages and planner.durable_prefix("r") == 0
    planner.add_pages("r", [7])  # rescheduled: its pages start dirty again
    assert states(planner, "r") == ["dirty"]


def test_host_rows_run_out_and_come_back():
    planner = PagePlanner(num_blocks=100, hot_buffer_blocks=2, host_rows=2, workers=1)
    planner.add_pages("a", [1, 2, 3])
    assert len(planner.plan(free_gpu_blocks=50).copies) == 2
    planner.release("a")
    planner.add_pages("b", [4])
    assert [copy.request_id for copy in planner.plan(free_gpu_blocks=50).copies] == ["b"]


def test_speculative_top_k_is_written_per_step_and_read_back_in_token_order():
    generator = torch.Generator().manual_seed(0)
    requests, steps, k, per_block = 3, 2, 4, 4
    block_table = torch.randperm(30, generator=generator)[: requests * 5].view(requests, 5).int()
    logical = torch.randint(0, 20, (requests * steps, k), generator=generator)
    logical[1, 2:] = -1
    logical[4, :] = -1
    by_step, slots, valid = per_step_slots(logical, block_table, per_block, steps)
    for row in range(requests * steps):
        request, step = divmod(row, steps)
        for column in range(k):
            entry = int(logical[row, column])
            expected = (
                -1 if entry < 0 else int(block_table[request, entry // per_block]) * per_block + entry % per_block
            )
            assert int(slots[row, column]) == expected == int(by_step[step, request, column])
    assert valid.tolist() == (logical >= 0).sum(-1).tolist()
    assert by_step.is_contiguous() and by_step.shape == (steps, requests, k)


def test_the_reader_copies_in_only_missing_host_entries_and_refuses_a_hot_buffer_below_the_selection():
    from weft.contracts.kv_cache import CompressedSpec, KVCacheGroupSpec
    from weft.contracts.kv_connector import ConnectorContext
    from weft_hisparse.connector import HiSparseConnector, HiSparseOptions, HiSparseStep, HostPage

    spec = CompressedSpec(block_size=8, dtype="float32", compress_ratio=4, entry_dim=3)  # 2 entries a page
    groups = (KVCacheGroupSpec("csa_kv", ("layer",), spec),)
    worker = HiSparseConnector(
        HiSparseOptions(host_pages=4, hot_buffer_blocks=1), "worker", groups, ConnectorContext("m")
    )
    worker.register_kv_caches({"layer": torch.zeros(6, 2, 3)})
    worker.host["layer"].copy_(
        torch.arange(4 * 2 * 3, dtype=torch.float32).view(4, 2, 3)
    )  # host row r, slot j: 6r + 3j..
    worker.bind_connector_metadata(
        HiSparseStep(host_pages=(HostPage("r", 1, 3),))
    )  # page 1 (entries 2, 3) at host row 3
    gathered = torch.full((1, 3, 3), -1.0)
    read = worker.read("layer", ["r"], torch.tensor([[0, 3, -1]]), gathered.clone())
    assert read[0, 0].tolist() == [-1.0] * 3 and read[0, 2].tolist() == [-1.0] * 3  # GPU page and "none" untouched
    assert read[0, 1].tolist() == [21.0, 22.0, 23.0]  # host row 3, slot 1
    worker.read("layer", ["r"], torch.tensor([[3, 2, -1]]), gathered.clone())
    assert worker.get_finished(set()).observations["host_entries_read_total"] == [1, 1]  # entry 3 was hot already
    with pytest.raises(
        ValueError, match="hot_buffer_blocks = 1 holds 2 entries per request and layer, but layer selected 3"
    ):
        worker.bind_connector_metadata(HiSparseStep(host_pages=(HostPage("r", 0, 0),)))
        worker.read("layer", ["r"], torch.tensor([[0, 2, 3]]), gathered.clone())


def _graph_worker(hot_buffer_blocks: int, rows: int, graph_hot_requests: int = 16):
    """A worker role over one csa_kv layer (pages of 2 entries of 3 floats) whose 6 host rows hold distinct values
    (host row r, slot j: 6r + 3j, +1, +2), decode graphs of up to ``rows`` rows captured (5 pages a row). Returns it
    and a copy of its host pool: the reference every read is checked against."""
    from weft.contracts.kv_cache import CompressedSpec, KVCacheGroupSpec
    from weft.contracts.kv_connector import CapturedSparseEntryReader, ConnectorContext
    from weft_hisparse.connector import HiSparseConnector, HiSparseOptions

    spec = CompressedSpec(block_size=8, dtype="float32", compress_ratio=4, entry_dim=3)
    groups = (KVCacheGroupSpec("csa_kv", ("layer",), spec),)
    options = HiSparseOptions(host_pages=6, hot_buffer_blocks=hot_buffer_blocks, graph_hot_requests=graph_hot_requests)
    worker = HiSparseConnector(options, "worker", groups, ConnectorContext("m"))
    worker.register_kv_caches({"layer": torch.zeros(6, 2, 3)})
    assert isinstance(worker.sparse_entry_reader(), CapturedSparseEntryReader)
    host = torch.arange(6 * 2 * 3, dtype=torch.float32).view(6, 2, 3)
    worker.host["layer"].copy_(host)
    worker.capture_rows(rows=rows, max_model_len=40)
    return worker, host


def _graph_step(worker, request_ids, rows, picks, host_pages=(), gathered=None):
    """One replay as the runner drives it: the step's new host pages bound, the table refilled, ``picks`` read over
    entries the model gathered from the GPU blocks (``gathered``, all -1 by default), the report. Returns the entries
    read and the step's picks read from the hot buffer and from the host pool."""
    from weft_hisparse.connector import HiSparseStep

    worker.bind_connector_metadata(HiSparseStep(host_pages=tuple(host_pages)))
    worker.prepare_rows(request_ids, rows)
    if gathered is None:
        gathered = torch.full((rows, len(picks[0]), 3), -1.0)
    read = worker.read_rows("layer", torch.tensor(picks), gathered.clone())
    observations = worker.get_finished(set()).observations
    worker.clear_connector_metadata()
    counted = (sum(observations.get(name, [])) for name in ("hot_entries_read_total", "host_entries_read_total"))
    return read, tuple(counted)


def _expected(host, picks, pages_on_host, gathered=None):
    """What each row must read: for a pick of a page its request holds on the host, the host pool's bytes; what the
    model gathered (``gathered``, all -1 by default) for any other."""
    rows = torch.full((len(picks), len(picks[0]), host.shape[-1]), -1.0) if gathered is None else gathered.clone()
    for row, (request_picks, on_host) in enumerate(zip(picks, pages_on_host, strict=False)):
        for column, entry in enumerate(request_picks):
            if entry >= 0 and entry // 2 in on_host:
                rows[row, column] = host[on_host[entry // 2], entry % 2]
    return rows


def test_a_decode_graph_s_page_table_is_refilled_for_each_replay_and_nothing_of_the_last_step_leaks():
    """The reader a decode graph replays (core API 1.11, ``CapturedSparseEntryReader``): its per-step state is a static
    page table that ``prepare_rows`` refills on the host before each replay and ``read_rows`` reads with device
    operations only. Two steps with different rows, host pages and picks: each reads exactly its own."""
    from weft_hisparse.connector import HostPage

    worker, host = _graph_worker(hot_buffer_blocks=1, rows=4)
    # Step 1: a's pages 0 and 1 at host rows 4 and 2, b's page 3 at host row 5; two rows of padding.
    picks = [[0, 3, -1], [7, 6, 1], [0, 1, 2], [0, -1, -1]]
    host_pages = (HostPage("a", 0, 4), HostPage("a", 1, 2), HostPage("b", 3, 5))
    first, _ = _graph_step(worker, ["a", "b"], 4, picks, host_pages)
    assert torch.equal(first, _expected(host, picks, [{0: 4, 1: 2}, {3: 5}, {}, {}]))
    assert first[2].eq(-1).all() and first[3].eq(-1).all()  # padding rows read nothing from the host
    # Step 2: b is in row 0 now, c (no host page) in row 1, a finished, one padding row; b's page 2 went to the
    # host too. Each row picks pages its row held on the host in step 1 (a's page 0 in row 0, b's page 3 in row 1):
    # nothing of step 1 may leak.
    worker.get_finished({"a"})
    picks = [[0, 4, 6], [6, 7, 1], [0, 1, 3]]
    second, _ = _graph_step(worker, ["b", "c"], 3, picks, (HostPage("b", 2, 1),))
    assert torch.equal(second, _expected(host, picks, [{2: 1, 3: 5}, {}, {}]))
    assert worker._graph.row_pages.tolist()[:3] == [[-1, -1, 1, 5, -1], [-1] * 5, [-1] * 5]


def test_a_decode_graph_reads_host_entries_it_read_before_from_the_hot_buffer():
    """Over several replays every pick of a host page reads the host pool's bytes; a pick read in an earlier step
    comes from the request's hot buffer (two blocks: 4 entries), the others from the host pool, and the report
    counts each kind."""
    from weft_hisparse.connector import HostPage

    worker, host = _graph_worker(hot_buffer_blocks=2, rows=2)
    on_host = {0: 4, 1: 2, 2: 5}  # a's pages 0, 1, 2 (entries 0 to 5)
    steps = [([0, 3, 5], (0, 3)), ([3, 5, 1], (2, 1)), ([5, -1, 0], (2, 0))]
    host_pages = [HostPage("a", page, row) for page, row in on_host.items()]
    for index, (a_picks, reads) in enumerate(steps):
        picks = [a_picks, [0, 1, -1]]  # row 1: padding
        read, counted = _graph_step(worker, ["a"], 2, picks, host_pages if index == 0 else ())
        assert torch.equal(read, _expected(host, picks, [on_host, {}]))
        assert counted == reads, index
    # Which buffer serves them: the host bytes of entries 0 (hot) and 2 (never read) change behind the reader's back
    # (no step wrote them): the hot entry still reads its copy, the other the host pool as it is now.
    worker.host["layer"][4, 0] = worker.host["layer"][2, 0] = 99.0
    read, counted = _graph_step(worker, ["a"], 2, [[0, 2, -1], [-1, -1, -1]])
    assert read[0, 0].tolist() == host[4, 0].tolist() and read[0, 1].tolist() == [99.0] * 3
    assert counted == (1, 1)


def test_a_decode_graph_s_hot_buffer_evicts_the_least_recently_read_entry_and_stays_exact():
    """One block of hot entries (2) for a request picking more distinct host entries over time: each miss takes the
    entry read least recently (not the oldest copied in), a step's picks never evict each other (misses beyond the
    entries it did not read are read from the host, not kept), and every read is the host pool's."""
    from weft_hisparse.connector import HostPage

    worker, host = _graph_worker(hot_buffer_blocks=1, rows=1)
    on_host = {0: 3, 1: 1}  # entries 0 to 3
    steps = [
        ([0, 1, -1], (0, 2)),  # both copied in
        ([0, -1, -1], (1, 0)),  # 0 read again: 1 is now the least recently read
        ([2, -1, -1], (0, 1)),  # evicts 1, the least recently read (first in, first out would evict 0)
        ([0, -1, -1], (1, 0)),  # so 0 is still there
        ([1, 3, 2], (1, 2)),  # 2 read; one entry free (0's): 1 kept, 3 read from the host only
        ([3, 1, 0], (1, 2)),  # 1 read; 2's entry free: 3 kept, 0 not
        ([0, 3, -1], (1, 1)),
    ]
    host_pages = [HostPage("a", page, row) for page, row in on_host.items()]
    for index, (picks, reads) in enumerate(steps):
        read, counted = _graph_step(worker, ["a"], 1, [picks], host_pages if index == 0 else ())
        assert torch.equal(read, _expected(host, [picks], [on_host])), index
        assert counted == reads, index


def test_a_decode_graph_s_hot_buffer_serves_no_stale_bytes_to_the_next_holder_of_a_slice_or_a_host_row():
    """A finished request's slice goes to the next request, its host row to another request's page (written by that
    page's copy): the new holder reads the new bytes. With more requests than slices, one not in the replay gives its
    slice up and reads exactly (from the host) when it comes back."""
    from weft_hisparse.connector import HiSparseStep, HostPage
    from weft_hisparse.pages import PlannedCopy

    worker, host = _graph_worker(hot_buffer_blocks=1, rows=2)
    picks = [[2, 3], [0, 1]]
    read, counted = _graph_step(worker, ["a", "b"], 2, picks, (HostPage("a", 1, 3), HostPage("b", 0, 2)))
    assert torch.equal(read, _expected(host, picks, [{1: 3}, {0: 2}])) and counted == (0, 4)
    worker.get_finished({"a"})
    # a's host row 3 takes c's page 0 (its GPU block 5 written by the forward), which is later read from the host.
    worker.layers["layer"][5] = torch.tensor([[-5.0, -4.0, -3.0], [-2.0, -1.0, 0.5]])
    worker.bind_connector_metadata(HiSparseStep(copies=(PlannedCopy("c", 0, 5, 3),)))
    worker.wait_for_save()
    host[3] = worker.layers["layer"][5]
    worker.clear_connector_metadata()
    picks = [[0, 1], [1, 0]]  # c in a's row with a's slice, its page at a's host row; d reads the GPU
    read, counted = _graph_step(worker, ["c", "d"], 2, picks, (HostPage("c", 0, 3),))
    assert torch.equal(read, _expected(host, picks, [{0: 3}, {}])) and counted == (0, 2)
    # Two slices, three requests with host pages: e takes c's slice (c is not in this replay and was replayed less
    # recently than b), b still reads its copies; then c takes b's slice and reads exactly, from the host.
    picks = [[4, 5], [1, 0]]
    read, counted = _graph_step(worker, ["e", "b"], 2, picks, (HostPage("e", 2, 0),))
    assert torch.equal(read, _expected(host, picks, [{2: 0}, {0: 2}])) and counted == (2, 2)
    picks = [[0, 1], [5, 4]]
    read, counted = _graph_step(worker, ["c", "e"], 2, picks)
    assert torch.equal(read, _expected(host, picks, [{0: 3}, {2: 0}])) and counted == (2, 2)


def test_a_host_row_written_again_drops_its_copies_from_a_decode_graph_s_hot_buffer():
    """The hot buffer holds copies of host-pool entries: a copy to a host row (here under a request still reading it,
    which the planner never plans: the reader does not rely on that) drops the copies of that row's entries, and the
    next read is the new bytes, from the host."""
    from weft_hisparse.connector import HiSparseStep, HostPage
    from weft_hisparse.pages import PlannedCopy

    worker, host = _graph_worker(hot_buffer_blocks=1, rows=1)
    picks = [[0, 1]]
    read, counted = _graph_step(worker, ["a"], 1, picks, (HostPage("a", 0, 1),))
    assert torch.equal(read, _expected(host, picks, [{0: 1}])) and counted == (0, 2)
    read, counted = _graph_step(worker, ["a"], 1, picks)
    assert torch.equal(read, _expected(host, picks, [{0: 1}])) and counted == (2, 0)
    worker.layers["layer"][4] = -host[1]
    worker.bind_connector_metadata(HiSparseStep(copies=(PlannedCopy("z", 0, 4, 1),)))
    worker.wait_for_save()
    worker.clear_connector_metadata()
    host[1] = -host[1]
    read, counted = _graph_step(worker, ["a"], 1, picks)
    assert torch.equal(read, _expected(host, picks, [{0: 1}])) and counted == (0, 2)


def test_with_more_requests_than_slices_a_replay_reads_exactly_and_the_requests_without_one_cache_nothing():
    """One slice (``graph_hot_requests = 1``) for three requests with host pages in every replay: the first holds it
    and reads its repeated picks from the hot buffer; the other two read every pick from the host pool, exactly and
    without taking a slice from a request in the replay; once the holder ends, the next takes its slice."""
    from weft_hisparse.connector import HostPage

    worker, host = _graph_worker(hot_buffer_blocks=1, rows=4, graph_hot_requests=1)
    on_host = [{0: 1}, {0: 2}, {1: 3}]
    host_pages = (HostPage("a", 0, 1), HostPage("b", 0, 2), HostPage("c", 1, 3))
    picks = [[0, 1], [1, 0], [2, 3], [0, -1]]  # row 3: padding
    for index, reads in enumerate([(0, 6), (2, 4), (2, 4)]):
        read, counted = _graph_step(worker, ["a", "b", "c"], 4, picks, host_pages if index == 0 else ())
        assert torch.equal(read, _expected(host, picks, on_host + [{}])) and counted == reads, index
    assert list(worker._graph._slices) == ["a"] and worker._graph.keys[0, 1].eq(-1).all()  # the empty slice
    worker.get_finished({"a"})
    for reads in [(0, 4), (2, 2)]:  # b takes the slice: its first replay copies in, the next reads the copies
        read, counted = _graph_step(worker, ["b", "c"], 3, picks[1:])
        assert torch.equal(read, _expected(host, picks[1:], on_host[1:] + [{}])) and counted == reads


def test_the_hot_buffer_s_memory_is_bounded_by_graph_hot_requests_not_by_the_graph_s_rows(caplog):
    """Graphs of 8 rows with ``graph_hot_requests = 2``: two slices of 2 entries (and the row the torch path writes
    misses not kept to), whatever the rows; the bytes on the device (hot entries, their keys and stamps, the page
    table) logged at capture and reported once, as ``graph_buffer_bytes_total``. Fewer rows than the option: one
    slice per row."""
    import logging

    with caplog.at_level(logging.INFO, logger="weft.hisparse"):
        worker, _ = _graph_worker(hot_buffer_blocks=1, rows=8, graph_hot_requests=2)
    graph = worker._graph
    assert graph.keys.shape == (1, 3, 2) and [hot.shape for hot in graph.hot] == [(5, 3)]
    expected = 5 * 3 * 4 + 2 * (3 * 2 * 8) + 8 * 5 * 8  # float32 entries; int64 keys, stamps and page table
    assert graph.device_bytes == expected
    assert f"{expected / (1 << 20):.1f} MiB" in caplog.text and "2 requests x 2 entries x 1 layers" in caplog.text
    assert worker.get_finished(set()).observations["graph_buffer_bytes_total"] == [expected]
    assert "graph_buffer_bytes_total" not in worker.get_finished(set()).observations
    assert _graph_worker(hot_buffer_blocks=1, rows=2)[0]._graph.keys.shape == (1, 3, 2)  # 16 asked, 2 rows


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="set TRITON_INTERPRET=1 to run Triton on the CPU")
def test_the_read_kernel_interpreted_reads_and_keeps_what_the_torch_path_does():
    """The final select as a Triton kernel (on CUDA: the host loads predicated on misses), interpreted on the CPU,
    against the torch path over the same replays: hits, misses kept and not kept, picks of GPU pages (what the model
    gathered, distinct values here), picks of -1, a row whose request has no slice and a padding row. Both read the
    host pool's bytes or the gathered entries, and leave the same hot buffer behind."""
    from weft_hisparse.connector import HostPage
    from weft_hisparse.graph_reader import read_kernel

    workers = [_graph_worker(hot_buffer_blocks=1, rows=3, graph_hot_requests=1) for _ in range(2)]
    workers[1][0]._graph.kernel = read_kernel(torch.float32, 3)
    host = workers[0][1]
    on_host = [{0: 4, 1: 2}, {2: 5}, {}]
    host_pages = (HostPage("a", 0, 4), HostPage("a", 1, 2), HostPage("b", 2, 5))
    steps = [  # a holds the one slice (2 entries), b has none; row 2 is padding
        [[0, 1, 2, 7], [4, 5, 0, -1], [0, 1, -1, 3]],  # a: 3 misses, 2 kept; b: 2 misses, none kept
        [[1, 0, 3, -1], [5, 9, 4, 1], [2, 2, 2, 2]],  # a: 2 hits, 1 miss (no free entry: not kept)
        [[3, 2, 0, 6], [-1, -1, 4, 3], [-1, -1, -1, -1]],  # a: 1 hit, 2 misses, one kept in the entry not read
    ]
    generator = torch.Generator().manual_seed(0)
    for index, picks in enumerate(steps):
        gathered = torch.randn(3, 4, 3, generator=generator)
        reads = [
            _graph_step(worker, ["a", "b"], 3, picks, host_pages if index == 0 else (), gathered)
            for worker, _ in workers
        ]
        assert torch.equal(reads[0][0], _expected(host, picks, on_host, gathered)), index
        assert torch.equal(reads[1][0], reads[0][0]) and reads[1][1] == reads[0][1], index
    torch_path, kernel = (worker._graph for worker, _ in workers)
    assert torch.equal(kernel.keys, torch_path.keys) and torch.equal(kernel.hot[0][:2], torch_path.hot[0][:2])
    assert torch_path.counts.tolist() == [3, 11]


@pytest.mark.parametrize("seed", range(20))
def test_a_decode_graph_reads_the_host_pool_s_bytes_through_random_requests_picks_and_host_writes(seed):
    """Random replays: requests come and go, pages go to random host rows (shared ones too), host rows are written
    again (mostly rows no request holds, as the planner does, sometimes held ones), rows pick at random, the hot
    buffer has from none to one slice per row. Every read is the host pool's bytes, and every pick of a host page is
    counted once, from the hot buffer or the host."""
    import random

    from weft_hisparse.connector import HiSparseStep, HostPage
    from weft_hisparse.pages import PlannedCopy

    rng = random.Random(seed)
    rows = rng.choice([1, 2, 3])
    worker, host = _graph_worker(
        hot_buffer_blocks=rng.choice([1, 2]), rows=rows, graph_hot_requests=rng.randint(0, rows)
    )
    live: dict[str, dict[int, int]] = {}  # request -> its host pages
    for step in range(30):
        while len(live) < rng.randint(1, rows + 2):
            live[f"r{seed}.{step}.{len(live)}"] = {}
        if rng.random() < 0.2:
            ended = rng.choice(list(live))
            del live[ended]
            worker.get_finished({ended})
        row = rng.randrange(6)
        if rng.random() < 0.3 and (all(row not in pages.values() for pages in live.values()) or rng.random() < 0.2):
            block = rng.randrange(6)
            worker.layers["layer"][block] = torch.randn(2, 3, generator=torch.Generator().manual_seed(step))
            worker.bind_connector_metadata(HiSparseStep(copies=(PlannedCopy("x", 0, block, row),)))
            worker.wait_for_save()
            worker.clear_connector_metadata()
            host[row] = worker.layers["layer"][block]
        replayed = rng.sample(list(live), min(rows, len(live)))
        new_pages = []
        for request_id in replayed:
            page = rng.randrange(5)
            if rng.random() < 0.5 and page not in live[request_id]:
                live[request_id][page] = rng.randrange(6)
                new_pages.append(HostPage(request_id, page, live[request_id][page]))
        picks = [[entry if rng.random() < 0.8 else -1 for entry in rng.sample(range(10), 3)] for _ in range(rows)]
        on_host = [live[request_id] for request_id in replayed] + [{}] * (rows - len(replayed))
        read, counted = _graph_step(worker, replayed, rows, picks, new_pages)
        assert torch.equal(read, _expected(host, picks, on_host)), step
        host_picks = sum(
            entry // 2 in pages for row_picks, pages in zip(picks, on_host, strict=False) for entry in row_picks
        )
        assert sum(counted) == host_picks, step  # (a pick of -1 is in no page)


def test_the_connector_drops_a_preempted_request_s_planned_copies_and_lends_only_acknowledged_pages():
    from weft.contracts.kv_cache import CompressedSpec, KVCacheGroupSpec
    from weft.contracts.kv_connector import (
        ConnectorContext,
        ConnectorOutput,
        ConnectorStep,
        ConnectorStepRequest,
        LentBlock,
    )
    from weft_hisparse.connector import HiSparseConnector, HiSparseOptions, copy_name

    groups = (
        KVCacheGroupSpec(
            "csa_kv", ("layer",), CompressedSpec(block_size=8, dtype="float32", compress_ratio=4, entry_dim=3)
        ),
    )
    scheduler = HiSparseConnector(
        HiSparseOptions(host_pages=8, hot_buffer_blocks=1, keep_tail=1),
        "scheduler",
        groups,
        ConnectorContext("m", tp_size=2),
    )

    def step(computed, preempted=frozenset(), free=0):
        requests = tuple(
            ConnectorStepRequest(name, computed, 1, ((10, 11, 12, 13),)) for name in ("a",) if name not in preempted
        )
        return ConnectorStep(requests=requests, preempted=frozenset(preempted), free_blocks=(free,), num_blocks=(100,))

    first = scheduler.build_connector_meta(step(31))  # a decoding request with 4 full pages (32 tokens)
    assert [copy.gpu_block for copy in first.copies] == [10, 11, 12, 13] and scheduler.lent_blocks() == ()
    names = tuple(copy_name(copy) for copy in first.copies)
    scheduler.update_connector_output(ConnectorOutput(acknowledged={0: names}))  # one rank of two: nothing clean
    assert scheduler.build_connector_meta(step(32)).copies == () and scheduler.lent_blocks() == ()
    scheduler.update_connector_output(ConnectorOutput(acknowledged={1: names[:2]}))  # pages 0 and 1 clean
    scheduler.build_connector_meta(step(33))
    assert scheduler.lent_blocks() == (LentBlock("a", 0, 1), LentBlock("a", 0, 0))  # tail-first, below the watermark
    dropped = scheduler.build_connector_meta(step(34, preempted={"a"}))
    assert dropped.dropped == ("a",) and dropped.copies == () and scheduler.lent_blocks() == ()
    scheduler.update_connector_output(ConnectorOutput(acknowledged={1: names[2:]}))  # late: changes nothing
    assert scheduler.planner.pages == {} and sorted(scheduler.planner.free_host_rows) == list(range(8))


# End to end on a tiny DeepSeek V4 (CSA layers read their top-k through the connector).


def _dsv4_checkpoint(tmp_path_factory):
    pytest.importorskip("weft_dsv4")
    from weft_dsv4.config import CSA, HCA, SLIDING
    from weft_dsv4.tiny_checkpoint import tiny_config, write_checkpoint

    # index_topk=3 over 2 entries a page (csa_kv pages of 8 tokens): reads mix pinned and host pages.
    return write_checkpoint(
        tmp_path_factory.mktemp("hisparse"), tiny_config([CSA, SLIDING, HCA, CSA], hc_mult=2, index_topk=3), seed=5
    )


@pytest.fixture(scope="module")
def tiny_dsv4(tmp_path_factory):
    return _dsv4_checkpoint(tmp_path_factory)


def _generate(
    folder,
    hisparse: dict | None,
    num_kv_blocks: int,
    indexer_key_dtype: str = "auto",
    full_width: bool = False,
    graph_batch_sizes: list[int] | None = None,
    platform: str | None = None,
):
    from weft.entrypoints.llm import LLM
    from weft.sampling_params import SamplingParams

    engine = {
        "block_size": 8,
        "num_kv_blocks": num_kv_blocks,
        "max_model_len": 160,
        "max_num_batched_tokens": 32,
        "enable_prefix_caching": False,
    }
    if graph_batch_sizes is not None:
        engine["graph_batch_sizes"] = graph_batch_sizes
    else:
        engine["enforce_eager"] = True
    extra = (
        {"use": {"kv_connector": "hisparse"}, "plugins": {"hisparse": hisparse}}
        if hisparse is not None
        else {"plugins": {}}
    )
    extra["plugins"]["DeepseekV4ForCausalLM"] = {"indexer_key_dtype": indexer_key_dtype}
    if platform is not None:
        extra.setdefault("use", {})["platform"] = platform
        engine["dtype"] = "bfloat16"  # DeepSeek V4 decodes eagerly in float32 (no grouped GEMM): graphs need bf16
    llm = LLM(model=str(folder), engine=engine, **extra)
    if full_width:  # decode as on a GPU that captures graphs: every row padded to the entries max_model_len allows
        llm.engine.worker.model.model.decode_width_tokens = engine["max_model_len"]
    prompts = [
        torch.randint(2, 512, (length,), generator=torch.Generator().manual_seed(length)).tolist()
        for length in (9, 30, 47)
    ]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=56, ignore_eos=True))
    return [list(output.outputs[0].token_ids) for output in outputs], llm


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize(("indexer_key_dtype", "full_width"), [("auto", False), ("fp8_e4m3", False), ("auto", True)])
def test_hisparse_on_and_off_give_the_same_greedy_tokens_while_pages_spill_and_return(
    tiny_dsv4, indexer_key_dtype, full_width
):
    reference, _ = _generate(tiny_dsv4, None, num_kv_blocks=128, indexer_key_dtype=indexer_key_dtype)
    # 30 blocks a group for three requests growing to 103 tokens (13 csa_kv pages each): below the
    # watermark (3 blocks) clean pages are lent to the pool, other requests' new pages take them
    # (their own entries then come from the host), and one request is still preempted and
    # recomputed. Two blocks of hot rows (4 entries) for top-3 picks: entries are evicted and copied
    # in again in later steps.
    tokens, llm = _generate(
        tiny_dsv4,
        {"host_pages": 64, "hot_buffer_blocks": 2, "keep_tail": 2},
        num_kv_blocks=30,
        indexer_key_dtype=indexer_key_dtype,
        full_width=full_width,
    )
    assert tokens == reference
    connector = llm.engine.scheduler.connector
    assert connector.metric_totals["pages_copied_total"].total > 0
    assert connector.metric_totals["host_entries_read_total"].total > 0
    assert llm.engine.scheduler.num_preemptions > 0
    # Every request ended: no page left, every host row back in the pool, every lent block accounted for.
    planner = connector.scheduler_side.planner
    # The full prompt blocks of every request (8 tokens, one page each) were durable when it finished: published.
    assert len(planner.host_prefix) == 9 // 8 + 30 // 8 + 47 // 8
    cached = [row for rows in planner.host_prefix.values() for row in rows]
    assert planner.pages == {} and sorted(planner.free_host_rows + cached) == list(range(64))
    assert llm.engine.kv_cache_manager.num_free_blocks() == (30,) * len(llm.engine.kv_cache_manager.groups)
    # The worker's per-step state (the bound step) is cleared after every step, and ended requests left nothing.
    worker = llm.engine.worker.kv_connector.worker_side
    assert worker._step is None and worker._host_pages == {} and worker._hot == {}
    assert all(slot is None for slots in worker._slots.values() for slot in slots)


def _record_replayed_host_pages(monkeypatch) -> list[int]:
    """Per replay, the host pages its refilled page table points at (appended by every ``prepare_rows``)."""
    from weft_hisparse.connector import HiSparseConnector

    replayed_host_pages: list[int] = []
    prepare_rows = HiSparseConnector.prepare_rows

    def recording(self, request_ids, rows):
        prepare_rows(self, request_ids, rows)
        replayed_host_pages.append(int((self._graph.row_pages[:rows] >= 0).sum()))

    monkeypatch.setattr(HiSparseConnector, "prepare_rows", recording)
    return replayed_host_pages


@pytest.mark.usefixtures("one_torch_thread")
def test_decode_graphs_read_host_pages_through_the_refilled_page_table_with_the_same_greedy_tokens(
    tiny_dsv4, eager_replay_platform, monkeypatch
):
    """The runner's graph path (static buffers, padding rows, the model reading nothing on the host; on the CPU a
    'replay' runs the captured function again) with HiSparse spilling as in the test above: the reads of reclaimed
    pages go through the page table refilled before every replay, and the greedy tokens stay plain DeepSeek V4's."""
    reference, _ = _generate(tiny_dsv4, None, num_kv_blocks=128)  # eagerly
    assert not eager_replay_platform
    replayed_host_pages = _record_replayed_host_pages(monkeypatch)
    tokens, llm = _generate(
        tiny_dsv4,
        {"host_pages": 64, "hot_buffer_blocks": 2, "keep_tail": 2},
        num_kv_blocks=30,
        graph_batch_sizes=[1, 2, 4],
    )
    assert sorted(llm.engine.runner.graphs) == [1, 2, 4] and eager_replay_platform
    assert len(replayed_host_pages) == len(eager_replay_platform)  # the table was refilled before every replay
    assert max(replayed_host_pages) > 0  # and replays read pages from the host
    _assert_replays_read_the_hot_buffer(llm)
    assert tokens == reference


def _assert_replays_read_the_hot_buffer(llm) -> None:
    """Replays read picks of host pages both from the host pool and from the hot buffer (picks an earlier step read),
    and every request's slice went back when it ended."""
    worker = llm.engine.worker.kv_connector.worker_side
    from_hot, from_host = worker._graph.counts.tolist()
    assert from_hot > 0 and from_host > 0, (from_hot, from_host)
    assert worker._graph._slices == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_on_a_gpu_captured_decode_graphs_read_host_pages_with_plain_deepseek_v4_s_greedy_tokens(tiny_dsv4, monkeypatch):
    """The test above with real CUDA graphs (bf16: in float32 DeepSeek V4 decodes eagerly): the page table lives in a
    static device buffer refilled before each replay, replays read the pinned host pool through its device address
    and keep what they read in the hot buffer on the device, from which later replays read it."""
    reference, _ = _generate(tiny_dsv4, None, num_kv_blocks=128, platform="cuda")  # eagerly
    replayed_host_pages = _record_replayed_host_pages(monkeypatch)
    tokens, llm = _generate(
        tiny_dsv4,
        {"host_pages": 64, "hot_buffer_blocks": 2, "keep_tail": 2},
        num_kv_blocks=30,
        graph_batch_sizes=[1, 2, 4],
        platform="cuda",
    )
    assert sorted(llm.engine.runner.graphs) == [1, 2, 4]
    assert max(replayed_host_pages, default=0) > 0  # replays read pages from the host
    _assert_replays_read_the_hot_buffer(llm)
    assert tokens == reference


def test_sized_from_memory_the_groups_split_by_need_and_the_sparse_group_gets_its_share_of_it(tiny_dsv4):
    from weft.entrypoints.llm import LLM

    engine = {"block_size": 8, "max_model_len": 160, "cpu_kv_cache_bytes": 4 << 20, "enable_prefix_caching": False}
    plain = LLM(model=str(tiny_dsv4), engine=engine).engine.core
    sparse = LLM(
        model=str(tiny_dsv4), engine=engine, use={"kv_connector": "hisparse"}, plugins={"hisparse": {"gpu_share": 0.1}}
    ).engine.core
    groups = plain.scheduler.kv_cache.groups
    block_bytes = {group.name: group.spec.page_size_bytes() * len(group.layer_names) for group in groups}
    need = {group.name: group.spec.blocks_for_tokens(160) * block_bytes[group.name] for group in groups}
    assert len(set(need.values())) > 2  # the groups' needs differ: an equal split would waste most of the bytes

    def shares(core):
        return {
            group.name: count * block_bytes[group.name] / (4 << 20)
            for count, group in zip(core.num_blocks, core.scheduler.kv_cache.groups, strict=False)
        }

    # Without the connector every group holds the same number of full-length requests.
    full_length = {
        group.name: count // group.spec.blocks_for_tokens(160)
        for count, group in zip(plain.num_blocks, groups, strict=False)
    }
    assert max(full_length.values()) - min(full_length.values()) <= 1, full_length
    for name, share in shares(plain).items():
        assert share == pytest.approx(need[name] / sum(need.values()), rel=0.02, abs=1e-4), name
    weighed = {name: value * (0.1 if name == "csa_kv" else 1.0) for name, value in need.items()}
    for name, share in shares(sparse).items():
        assert share == pytest.approx(weighed[name] / sum(weighed.values()), rel=0.02, abs=1e-4), name
    assert shares(sparse)["csa_kv"] < shares(plain)["csa_kv"] / 2  # the freed bytes go to the groups on the device


def _concurrency_checkpoint(tmp_path_factory):
    from weft_dsv4.config import CSA
    from weft_dsv4.tiny_checkpoint import tiny_config, write_checkpoint

    # The CSA entries (256 wide) dominate a request's KV, as at long context: the indexer keys are 16 wide, and
    # the ring (a window of 8) and the compressor state are small.
    config = tiny_config(
        [CSA, CSA], hc_mult=2, index_topk=3, head_dim=256, index_head_dim=16, qk_rope_head_dim=8, sliding_window=8
    )
    return write_checkpoint(tmp_path_factory.mktemp("hisparse_concurrency"), config, seed=5)


def _most_holding_blocks(folder, hisparse: dict | None):
    """Twelve 600-token requests at once in the same KV bytes: the most holding blocks at once (as
    ``bench/gpu_dsv4.py --part hisparse`` counts them), preemptions, greedy tokens and the csa_kv pool."""
    from weft.entrypoints.llm import LLM
    from weft.sampling_params import SamplingParams

    engine = {
        "block_size": 4,
        "max_model_len": 672,
        "max_num_batched_tokens": 512,
        "max_num_seqs": 12,
        "cpu_kv_cache_bytes": 2_100_000,
        "enable_prefix_caching": False,
    }
    extra = {"use": {"kv_connector": "hisparse"}, "plugins": {"hisparse": hisparse}} if hisparse is not None else {}
    llm = LLM(model=str(folder), engine=engine, **extra)
    core = llm.engine.core
    scheduler, kv_cache = core.scheduler, core.scheduler.kv_cache
    schedule, most = scheduler.schedule, [0]

    def recording():
        output = schedule()
        most[0] = max(most[0], sum(1 for request in scheduler.running if kv_cache.holds(request.request_id)))
        return output

    scheduler.schedule = recording
    prompts = torch.randint(2, 512, (12, 600), generator=torch.Generator().manual_seed(0)).tolist()
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    csa = [group.name for group in core.scheduler.kv_cache.groups].index("csa_kv")
    pool = core.num_blocks[csa] / core.scheduler.kv_cache.groups[csa].spec.blocks_for_tokens(672)
    return [list(output.outputs[0].token_ids) for output in outputs], most[0], scheduler.num_preemptions, pool


@pytest.mark.usefixtures("one_torch_thread")
def test_with_a_csa_pool_of_about_one_request_many_more_requests_decode_at_once_and_none_is_preempted(tmp_path_factory):
    folder = _concurrency_checkpoint(tmp_path_factory)
    reference, plain_most, plain_preemptions, plain_pool = _most_holding_blocks(folder, None)
    tokens, most, preemptions, pool = _most_holding_blocks(
        folder, {"host_pages": 12 * 170, "hot_buffer_blocks": 3, "gpu_share": 0.1}
    )
    assert plain_pool >= 4 and pool < 1.25  # every group holds 4 requests without HiSparse; csa_kv ~1.2 with it
    assert plain_most == 4 and plain_preemptions == 0
    # One prefill at a time holds all its pages (it reads every entry); the decoding ones keep their dirty and last
    # pages. A request whose prefill would not fit waits instead of being admitted and then preempted, and one that
    # fits has pages unpinned for it before its first chunk (128 blocks, more than the watermark of 20 leaves free).
    assert preemptions == 0
    assert most >= 3 * plain_most, (most, plain_most)  # all 12: as many as the ring and compressor state hold
    assert tokens == reference


# The admission gate driven through the engine's scheduler, with a stand-in for the workers.


def _gated_scheduler(num_blocks: int, max_num_seqs: int = 8):
    """The engine's scheduler over one csa_kv group of ``num_blocks`` pages of 8 tokens, HiSparse as its connector."""
    from weft.contracts.kv_cache import CompressedSpec, KVCacheGroupSpec
    from weft.contracts.kv_connector import ConnectorContext
    from weft.engine.core.kv_cache_manager import KVCacheManager
    from weft.engine.core.kv_connector import SchedulerConnector
    from weft.engine.core.scheduler import Scheduler
    from weft_hisparse.connector import HiSparseConnector, HiSparseOptions

    groups = (
        KVCacheGroupSpec(
            "csa_kv", ("layer",), CompressedSpec(block_size=8, dtype="float32", compress_ratio=4, entry_dim=2)
        ),
    )
    connector = SchedulerConnector(
        HiSparseConnector,
        HiSparseOptions(host_pages=512, hot_buffer_blocks=1, keep_tail=2),
        groups,
        ConnectorContext("m"),
    )
    return Scheduler(KVCacheManager(groups, [num_blocks], False), max_num_seqs, 64, 512, True, connector)


def _step(scheduler) -> set[str]:
    """One step as the workers would run it: each request that samples gets token 7, every planned copy is
    acknowledged. Returns the requests scheduled."""
    import msgspec

    from weft.contracts.executor import ModelRunnerOutput
    from weft.contracts.kv_connector import ConnectorOutput
    from weft_hisparse.connector import HiSparseStep, copy_name

    step = scheduler.schedule()
    copies = msgspec.msgpack.decode(step.kv_connector_metadata, type=HiSparseStep).copies
    ids = list(step.num_scheduled_tokens)
    tokens = [7 if scheduler._planned[name] == scheduler.requests[name].num_tokens else None for name in ids]
    report = ConnectorOutput(acknowledged={0: tuple(copy_name(copy) for copy in copies)})
    scheduler.update_from_output(step, ModelRunnerOutput(ids, tokens, connector_output=report), report)
    return set(ids)


def _request(name: str, prompt: int | list[int], max_tokens: int, **params):
    """A request of ``prompt`` (token ids, or how many of token 3)."""
    from weft.engine.core.request import Request
    from weft.sampling_params import SamplingParams

    token_ids = [3] * prompt if isinstance(prompt, int) else prompt
    return Request(
        name, token_ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params), max_tokens, frozenset()
    )


def test_a_gated_request_keeps_its_place_while_smaller_ones_keep_arriving():
    scheduler = _gated_scheduler(num_blocks=20)
    for name in ("s0", "s1", "s2"):
        scheduler.add(_request(name, 9, max_tokens=30))
    for _ in range(4):
        _step(scheduler)
    # 16 pages for its prefill: beside three decoding requests (each keeps its last two pages and the one it
    # writes) it does not fit.
    scheduler.add(_request("big", 120, max_tokens=4))
    admitted_at = None
    for index in range(80):
        scheduler.add(_request(f"late{index}", 9, max_tokens=30))  # a newcomer every step, two pages each
        if "big" in _step(scheduler) and admitted_at is None:
            admitted_at = index
    assert admitted_at is not None, "the large request at the head of the queue was passed over for good"
    # It went in once the requests ahead of it drained; none admitted behind it took the pages it waited for.
    assert admitted_at <= 30
    assert scheduler.num_preemptions == 0


def test_a_request_preempted_and_admitted_again_is_gated_on_its_prompt_and_outputs():
    scheduler = _gated_scheduler(num_blocks=20)
    scheduler.add(_request("a", 9, max_tokens=60))
    for _ in range(50):  # 9 prompt tokens and 50 outputs: 59 tokens, 8 pages with the next one
        _step(scheduler)
    scheduler.add(_request("b", 100, max_tokens=8))  # 13 pages: fits beside a's last pages
    assert _step(scheduler) == {"a", "b"}  # b computes the first 63 tokens of its prompt
    a = scheduler.requests["a"]
    scheduler.running.remove(a)
    scheduler._preempt(a)  # as the scheduler preempts for blocks: a goes back to the head of the queue
    # a recomputes 59 tokens: its 8 pages do not fit beside b's prefill (13), though its prompt's 2 would.
    assert _step(scheduler) == {"b"}
    while scheduler.has_unfinished:
        _step(scheduler)
    assert scheduler.num_preemptions == 1  # ours: none to make room for a recompute admitted too early


@pytest.mark.parametrize("prompt_logprobs", [None, 1])
def test_a_request_asking_for_prompt_logprobs_is_gated_like_the_others(prompt_logprobs):
    scheduler = _gated_scheduler(num_blocks=20)
    scheduler.add(_request("a", 9, max_tokens=20))
    for _ in range(3):
        _step(scheduler)
    scheduler.add(_request("b", 100, max_tokens=8))  # 13 pages, held while it computes its prompt
    assert _step(scheduler) == {"a", "b"}
    # 8 pages: not beside b's prefill and a's last pages. Prompt logprobs rule out a cached or loaded prefix,
    # not the gate.
    scheduler.add(_request("c", 60, max_tokens=8, prompt_logprobs=prompt_logprobs))
    assert _step(scheduler) == {"a", "b"}
    while scheduler.has_unfinished:
        _step(scheduler)
    assert scheduler.num_preemptions == 0


def test_short_prompts_are_let_in_only_as_many_as_can_keep_their_last_pages():
    scheduler = _gated_scheduler(num_blocks=20)
    for index in range(8):  # two pages each to prefill, but three each once decoding (two kept, one written)
        scheduler.add(_request(f"s{index}", 9, max_tokens=40))
    most = 0
    while scheduler.has_unfinished:
        most = max(most, len(_step(scheduler)))
    assert most == 6 and scheduler.num_preemptions == 0  # 6 * 3 pages fit in 20; 8 * 3 do not


# The host prefix cache: finished requests' durable prefixes, read back by later requests' prefix hits.


def test_a_finished_request_publishes_only_the_full_blocks_of_its_contiguous_durable_prefix():
    planner = PagePlanner(num_blocks=100, hot_buffer_blocks=2, host_rows=8, workers=2)
    planner.add_pages("r", [10, 11, 12, 13, 14])
    plan = planner.plan(free_gpu_blocks=50)
    rows = [copy.host_row for copy in plan.copies]
    planner.acknowledge(0, plan.copies)
    planner.acknowledge(1, plan.copies[:3] + plan.copies[4:])  # page 3's copy: one worker of two
    assert planner.durable_prefix("r") == 3
    # Two pages a prefix block: block 0 (pages 0, 1) is durable in full; block 1 (pages 2, 3) is not.
    planner.release("r", [b"h0", b"h1"], pages_per_block=2)
    assert planner.host_prefix == {b"h0": (rows[0], rows[1])}
    assert sorted(planner.free_host_rows) == sorted(set(range(8)) - {rows[0], rows[1]})


def test_a_preempted_request_publishes_nothing_and_its_late_acknowledgements_change_nothing():
    planner = PagePlanner(num_blocks=100, hot_buffer_blocks=2, host_rows=4, workers=1)
    planner.add_pages("r", [5, 6])
    plan = planner.plan(free_gpu_blocks=50)
    planner.release("r")  # preempted: the engine passes no hashes
    planner.acknowledge(0, plan.copies)
    planner.add_pages("r", [7, 8])  # admitted again: its pages start dirty, their old copies count for nothing
    planner.release("r", [b"h0", b"h1"])  # finished before any new copy was acknowledged
    assert planner.host_prefix == {} and sorted(planner.free_host_rows) == [0, 1, 2, 3]


def test_published_rows_are_evicted_least_recently_used_deepest_first_when_copies_need_rows():
    planner = PagePlanner(num_blocks=100, hot_buffer_blocks=2, host_rows=4, workers=1)
    planner.add_pages("a", [1, 2, 3])
    planner.acknowledge(0, planner.plan(free_gpu_blocks=50).copies)
    rows_a = [page.host_row for page in planner.pages["a"]]
    planner.release("a", [b"a0", b"a1", b"a2"])
    planner.add_pages("b", [4])
    planner.acknowledge(0, planner.plan(free_gpu_blocks=50).copies)  # the one free row
    planner.release("b", [b"a0"])  # the same first block: the first holder keeps it, b's row goes back
    assert list(planner.host_prefix) == [b"a2", b"a1", b"a0"]  # a0 used last
    assert len(planner.free_host_rows) == 1
    planner.add_pages("c", [5, 6, 7])
    copies = planner.plan(free_gpu_blocks=50).copies
    # One free row, then a2's and a1's (the deepest, least recently used); a0 stays.
    assert [copy.host_row for copy in copies][1:] == [rows_a[2], rows_a[1]]
    assert planner.host_prefix == {b"a0": (rows_a[0],)}


def test_the_connector_publishes_a_finished_request_s_prompt_blocks_by_the_engine_s_hashes():
    from weft.engine.core.kv_cache_manager import block_hashes

    scheduler = _gated_scheduler(num_blocks=20)
    prompt = list(range(40, 67))  # 27 tokens: three full blocks of 8
    scheduler.add(_request("a", prompt, max_tokens=6))
    while scheduler.has_unfinished:
        _step(scheduler)
    planner = scheduler.connector.scheduler_side.planner
    assert list(planner.host_prefix) == block_hashes(prompt, 8)[::-1]  # deepest first in LRU order
    cached = [row for rows in planner.host_prefix.values() for row in rows]
    assert len(cached) == 3 and sorted(cached + planner.free_host_rows) == list(range(512))


def _run_host_prefix_case(folder, hisparse: bool):
    """A 47-token prompt, then six others that take the small csa_kv pool's blocks (and so its GPU prefix cache of
    the first prompt), then a prompt sharing the first one's 40 leading tokens (five blocks). Returns the greedy
    tokens of every request, the last request's cached tokens and the tokens scheduled while it ran, and the LLM."""
    from weft.entrypoints.llm import LLM
    from weft.sampling_params import SamplingParams

    def prompt(seed, length):
        return torch.randint(2, 512, (length,), generator=torch.Generator().manual_seed(seed)).tolist()

    first = prompt(47, 47)
    last = first[:40] + prompt(99, 10)
    batches = [[first], [prompt(seed, 38) for seed in (1, 2, 3)], [prompt(seed, 38) for seed in (4, 5, 6)], [last]]
    # Sized from memory: with HiSparse csa_kv gets a tenth of its need (27 pages), the other groups theirs (273).
    engine = {
        "block_size": 8,
        "max_model_len": 160,
        "max_num_batched_tokens": 64,
        "cpu_kv_cache_bytes": 16_000_000,
        "enable_prefix_caching": hisparse,
    }
    hisparse_options = {"host_pages": 64, "gpu_share": 0.1}
    extra = {"use": {"kv_connector": "hisparse"}, "plugins": {"hisparse": hisparse_options}} if hisparse else {}
    llm = LLM(model=str(folder), engine=engine, **extra)
    scheduler = llm.engine.core.scheduler
    schedule, scheduled = scheduler.schedule, []

    def recording():
        output = schedule()
        scheduled.append(sum(output.num_scheduled_tokens.values()))
        return output

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = []
    for batch in batches:
        if batch[0] is last:
            scheduler.schedule = recording
            if hisparse:  # the scenario: csa_kv's GPU prefix blocks of the shared prefix are gone, the others' not
                kv_cache = llm.engine.core.scheduler.kv_cache
                csa = [group.name for group in kv_cache.groups].index("csa_kv")
                assert kv_cache.find_computed_prefix(last).num_tokens == 0
                assert kv_cache.find_computed_prefix(last, (csa,)).fillable_tokens == 40
        outputs = llm.generate(batch, params, use_tqdm=False)
        tokens += [list(output.outputs[0].token_ids) for output in outputs]
    return tokens, outputs[0].num_cached_tokens, sum(scheduled), llm


@pytest.mark.usefixtures("one_torch_thread")
def test_a_prompt_prefix_in_the_host_prefix_cache_is_loaded_instead_of_computed_with_the_same_greedy_tokens(tiny_dsv4):
    reference, reference_cached, reference_scheduled, _ = _run_host_prefix_case(tiny_dsv4, hisparse=False)
    tokens, cached, scheduled, llm = _run_host_prefix_case(tiny_dsv4, hisparse=True)
    assert tokens == reference
    # The shared prefix's csa_kv pages came from the host (five pages of 8 tokens), the other groups from the GPU
    # prefix cache, the ring and compressor state from its snapshots: 40 tokens fewer computed.
    assert (reference_cached, cached) == (0, 40)
    assert scheduled == reference_scheduled - 40
    connector = llm.engine.scheduler.connector
    assert connector.stats.hit_tokens == 40
    assert connector.metric_totals["host_prefix_pages_loaded_total"].total == 5
    assert llm.engine.core.scheduler.kv_cache.stats.hit_tokens == 0  # no block of it was found in every group


def _two_group_scheduler():
    """The engine's scheduler with prefix caching over csa_kv and a second prefix-cacheable group (hca_kv), pages
    of 8 tokens, HiSparse as its connector."""
    from weft.contracts.kv_cache import CompressedSpec, KVCacheGroupSpec
    from weft.contracts.kv_connector import ConnectorContext
    from weft.engine.core.kv_cache_manager import KVCacheManager
    from weft.engine.core.kv_connector import SchedulerConnector
    from weft.engine.core.scheduler import Scheduler
    from weft_hisparse.connector import HiSparseConnector, HiSparseOptions

    spec = CompressedSpec(block_size=8, dtype="float32", compress_ratio=4, entry_dim=2)
    groups = (KVCacheGroupSpec("csa_kv", ("csa",), spec), KVCacheGroupSpec("hca_kv", ("hca",), spec))
    connector = SchedulerConnector(
        HiSparseConnector,
        HiSparseOptions(host_pages=64, hot_buffer_blocks=1, keep_tail=2),
        groups,
        ConnectorContext("m"),
    )
    return Scheduler(KVCacheManager(groups, [40, 40], True), 8, 64, 512, True, connector)


def _evict_cached_blocks(scheduler, group: int) -> None:
    """The pool of ``group`` hands out every free block (as other requests' new blocks would): its prefix
    cache is gone."""
    pool = scheduler.kv_cache.pools[group]
    taken = [pool.take() for _ in range(pool.num_free)]
    for block in taken:
        pool.release(block)


@pytest.mark.parametrize("hca_cached", [True, False])
def test_a_host_prefix_hit_covers_only_what_the_other_groups_hold_in_the_gpu_prefix_cache(hca_cached):
    """Only csa_kv is on the host: its pages are loaded only for tokens whose blocks of every other group the engine's
    prefix cache still holds (else the hit could not be exact), in whole blocks of every group."""
    import msgspec

    from weft.engine.core.kv_cache_manager import block_hashes
    from weft_hisparse.connector import HiSparseStep

    scheduler = _two_group_scheduler()
    prompt = list(range(40, 67))  # 27 tokens: three full blocks
    scheduler.add(_request("a", prompt, max_tokens=6))
    while scheduler.has_unfinished:
        _step(scheduler)
    planner = scheduler.connector.scheduler_side.planner
    assert len(planner.host_prefix) == 3
    _evict_cached_blocks(scheduler, 0)
    if not hca_cached:
        _evict_cached_blocks(scheduler, 1)
    scheduler.add(_request("b", prompt[:24] + [5, 6, 7], max_tokens=2))
    step = scheduler.schedule()
    loads = msgspec.msgpack.decode(step.kv_connector_metadata, type=HiSparseStep).loads
    new = step.new_requests[0]
    if hca_cached:
        # Three blocks: csa_kv's from the host into fresh blocks, hca_kv's shared from the GPU prefix cache.
        assert new.num_computed_tokens == 24 and step.num_scheduled_tokens["b"] == 3 and step.has_sync_kv_loads
        assert [load.gpu_block for load in loads] == list(new.block_ids[0][:3])
        hashes = block_hashes(prompt[:24], 8)
        assert [load.host_row for load in loads] == [planner.host_prefix[key][0] for key in hashes]
        assert list(new.block_ids[1][:3]) == [scheduler.kv_cache.pools[1].lookup(key) for key in hashes]
        assert scheduler.kv_cache.stats.hit_tokens == 0 and scheduler.connector.stats.hit_tokens == 24
    else:
        assert new.num_computed_tokens == 0 and step.num_scheduled_tokens["b"] == 27 and not step.has_sync_kv_loads
        assert loads == () and scheduler.connector.stats.hit_tokens == 0
