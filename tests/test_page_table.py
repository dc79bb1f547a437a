"""Page table + token pool, the row manager, and the ragged index helpers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvplug.interface import InvalidArgumentError, OutOfMemoryError
from kvplug.memory.page_table import PageTable, align_up
from kvplug.memory.ragged import expand_pages, ragged_coordinates
from kvplug.memory.request import RequestTable

CPU = torch.device("cpu")


def make_table(rows=4, max_seq_len=40, dummy=100) -> PageTable:
    return PageTable(rows, max_seq_len, dummy_location=dummy, device=CPU)


def i32(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


# ---------------------------------------------------------------------- shapes


@pytest.mark.parametrize("max_seq_len,width", [(1, 32), (32, 32), (33, 64), (40, 64), (4096, 4096)])
def test_shapes_are_rows_plus_dummy_by_aligned_length(max_seq_len, width):
    table = make_table(rows=3, max_seq_len=max_seq_len)
    assert table.row_width == width == align_up(max_seq_len, 32)
    for tensor in (table.table, table.token_pool):
        assert tensor.shape == (4, width) and tensor.dtype == torch.int32 and tensor.device == CPU
    assert table.dummy_row == 3
    assert bool((table.table[3] == 100).all()) and bool((table.table[:3] == 0).all())
    assert bool((table.token_pool == 0).all())


def test_bad_sizes_are_rejected():
    for rows, length in ((0, 8), (2, 0), (2.5, 8), (True, 8)):
        with pytest.raises(InvalidArgumentError):
            PageTable(rows, length, dummy_location=0, device=CPU)


# ---------------------------------------------------------------------- writes and reads


def test_location_and_token_writes_land_where_asked():
    table = make_table()
    table.write_locations(1, 3, i32(7, 8, 9))
    table.write_tokens(1, 0, i32(5, 6, 7, 8))
    assert table.locations(1, 2, 7).tolist() == [0, 7, 8, 9, 0]
    assert table.read_tokens(1, 0, 5).tolist() == [5, 6, 7, 8, 0]
    assert table.locations(4, 0, 2).tolist() == [100, 100]  # the dummy row can be read


def _bad_calls(table: PageTable):
    return {
        "write past the row": lambda: table.write_locations(0, 62, i32(1, 2, 3)),
        "negative start": lambda: table.write_tokens(0, -1, i32(1)),
        "dummy row write": lambda: table.write_locations(4, 0, i32(1)),
        "row out of range": lambda: table.write_tokens(5, 0, i32(1)),
        "bool row": lambda: table.write_tokens(True, 0, i32(1)),
        "int64 values": lambda: table.write_tokens(0, 0, torch.tensor([1, 2])),
        "2-D values": lambda: table.write_locations(0, 0, i32(1, 2).view(1, 2)),
        "read past the row": lambda: table.read_tokens(0, 60, 65),
        "reversed range": lambda: table.locations(0, 5, 4),
        "append past the row": lambda: table.append_tokens([0, 1], [3, 64], i32(1, 2)),
        "append to the dummy row": lambda: table.append_tokens([4], [0], i32(1)),
        "append length mismatch": lambda: table.append_tokens([0, 1], [0], i32(1, 2)),
        "gather past the row": lambda: table.gather_tokens([0], [60], [65]),
        "gather negative length": lambda: table.gather_tokens([0], [5], [4]),
        "gather bad row": lambda: table.gather_tokens([7], [0], [1]),
        "scatter into the dummy row": lambda: table.scatter_locations(np.array([4 * 64]), i32(1)),
        "scatter negative index": lambda: table.scatter_locations(np.array([-1]), i32(1)),
        "scatter length mismatch": lambda: table.scatter_locations(np.array([1, 2]), i32(1)),
        "append a float position": lambda: table.append_tokens([0], [1.5], i32(1)),
        "gather from a device tensor": lambda: table.gather_tokens(torch.tensor([0], device="meta"), [0], [1]),
    }


@pytest.mark.parametrize("case", sorted(_bad_calls(make_table())))
def test_bad_calls_raise_and_change_nothing(case):
    table = make_table()
    table.table[:4].random_(0, 50)
    table.token_pool.random_(0, 50)
    before = (table.table.clone(), table.token_pool.clone())
    with pytest.raises(InvalidArgumentError):
        _bad_calls(table)[case]()
    assert torch.equal(table.table, before[0]) and torch.equal(table.token_pool, before[1])


@pytest.mark.parametrize("host_views", [True, False])
def test_host_writes_reach_the_device_tables_in_one_flush(host_views):
    """Locations and prompt ids are written into the host arrays at once; the device tables (the
    same memory on a CPU pool, separate ones staged as on a GPU otherwise) equal a per-cell
    reference after ``flush``, and device-valued token writes skip the host."""
    table = PageTable(4, 64, dummy_location=100, device=CPU, host_views=host_views)
    assert table.mirrored != host_views
    expected = table.table.clone()
    table.write_row_pages(np.array([1, 3]), np.array([32, 0]), np.array([1, 1]), i32(32, 48).numpy(), 16)
    expected[1, 32:48] = torch.arange(32, 48, dtype=torch.int32)
    expected[3, 0:16] = torch.arange(48, 64, dtype=torch.int32)
    table.write_locations(0, 3, i32(7, 8))
    expected[0, 3:5] = i32(7, 8)
    table.write_tokens(2, 0, i32(4, 5, 6))
    assert torch.equal(torch.from_numpy(table.host_table), expected)
    assert table.host_tokens[2, :4].tolist() == [4, 5, 6, 0]
    assert table.has_staged_writes == table.mirrored
    table.flush()
    assert not table.has_staged_writes
    assert torch.equal(table.table, expected) and table.token_pool[2, :3].tolist() == [4, 5, 6]
    table.write_flat(table.token_pool, np.array([1 * 64 + 5]), i32(9))
    assert table.token_pool[1, 5] == 9 and int(table.token_pool.count_nonzero()) == 4
    assert table.host_tokens[1, 5] == (0 if table.mirrored else 9)  # device values skip the host arrays


def test_staged_writes_of_one_row_merge_into_one_range_and_keep_the_last_value():
    table = PageTable(2, 32, dummy_location=100, device=CPU, host_views=False)
    table.write_locations(0, 0, i32(1, 2, 3))
    table.write_locations(0, 1, i32(9))  # rewritten before the flush: the host value wins
    table.write_locations(0, 10, i32(4))
    table.flush()
    assert table.table[0, :11].tolist() == [1, 9, 3, 0, 0, 0, 0, 0, 0, 0, 4]


def test_host_views_need_cpu_memory():
    with pytest.raises(InvalidArgumentError, match="CPU memory"):
        PageTable(2, 32, dummy_location=0, device=torch.device("meta"), host_views=True)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 64), st.integers(0, 64)), max_size=6))
def test_gather_tokens_equals_a_per_request_reference(ranges):
    table = make_table()
    table.token_pool.copy_(torch.arange(table.token_pool.numel(), dtype=torch.int32).view_as(table.token_pool))
    rows = [row for row, _, _ in ranges]
    starts = [min(a, b) for _, a, b in ranges]
    ends = [max(a, b) for _, a, b in ranges]
    expected = [value for row, s, e in zip(rows, starts, ends) for value in table.token_pool[row, s:e].tolist()]
    assert table.gather_tokens(rows, starts, ends).tolist() == expected


def test_append_tokens_is_one_scatter_and_gather_tokens_at_reads_device_coordinates():
    table = make_table()
    table.append_tokens([2, 0, 3], [5, 0, 39], i32(11, 12, 13))
    assert table.token_pool[2, 5] == 11 and table.token_pool[0, 0] == 12 and table.token_pool[3, 39] == 13
    assert int(table.token_pool.count_nonzero()) == 3
    assert table.gather_tokens_at(i32(3, 2, 0), i32(39, 5, 0)).tolist() == [13, 11, 12]


def test_scatter_locations_writes_every_flat_index():
    table = make_table()
    table.scatter_locations(np.array([0 * 64 + 1, 0 * 64 + 63, 3 * 64 + 2]), i32(4, 5, 6))
    assert table.table[0, 1] == 4 and table.table[0, 63] == 5 and table.table[3, 2] == 6
    assert int(table.table[:4].count_nonzero()) == 3


# ---------------------------------------------------------------------- ragged helpers


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 50), st.integers(0, 7)), max_size=8))
def test_ragged_coordinates_equal_a_python_loop(ranges):
    rows = np.array([r for r, _, _ in ranges], dtype=np.int64)
    starts = np.array([s for _, s, _ in ranges], dtype=np.int64)
    lengths = np.array([n for _, _, n in ranges], dtype=np.int64)
    row_index, column_index = ragged_coordinates(rows, starts, lengths)
    expected = [(r, s + j) for r, s, n in ranges for j in range(n)]
    assert list(zip(row_index.tolist(), column_index.tolist())) == expected


def test_expand_pages_turns_page_starts_into_token_locations():
    assert expand_pages(i32(8, 0), 4).tolist() == [8, 9, 10, 11, 0, 1, 2, 3]
    assert expand_pages(i32(3, 1), 1).tolist() == [3, 1]


# ---------------------------------------------------------------------- request table rows


class _Rows:
    """The request table's row transitions as a row manager (open a request in the free row it
    names, close it again)."""

    def __init__(self, num_rows: int) -> None:
        self.table = RequestTable(num_rows)
        self.requests: dict[int, object] = {}

    def allocate(self) -> int:
        row = self.table.free_row()
        self.requests[row] = self.table.open(row, 1, 0, None)
        return row

    def free(self, row) -> None:
        request = self.requests.get(row) if isinstance(row, int) and not isinstance(row, bool) else None
        if request is None or not self.table.is_live(request):
            raise InvalidArgumentError(f"row {row!r} is not live")
        self.table.close(request)
        del self.requests[row]

    @property
    def live_rows(self) -> set[int]:
        return {request.row for request in self.table.live_requests}


def test_request_table_hands_out_every_row_once_then_runs_out():
    rows = _Rows(3)
    taken = [rows.allocate() for _ in range(3)]
    assert sorted(taken) == [0, 1, 2] and rows.table.num_live == 3
    with pytest.raises(OutOfMemoryError, match="max_running_reqs=3"):
        rows.allocate()
    rows.free(taken[1])
    assert rows.allocate() == taken[1]


@pytest.mark.parametrize("bad", [3, -1, True, "0", 1.0])
def test_request_table_refuses_bad_rows_without_changing_state(bad):
    table = RequestTable(3)
    table.open(table.free_row(), 1, 0, None)
    state = (table.num_live, table.generation)
    with pytest.raises(InvalidArgumentError):
        table.open(bad, 1, 0, None)
    with pytest.raises(InvalidArgumentError, match="already belongs"):
        table.open(0, 1, 0, None)
    assert (table.num_live, table.generation) == state
    table.check_integrity()


def test_a_closed_request_keeps_its_final_lengths_and_its_row_is_reused():
    table = RequestTable(2, row_width=32)
    first = table.open(table.free_row(), 5, 2, None)
    table.schedule(np.array([first.row]), np.array([5]))
    table.computed(np.array([first.row]))
    table.close(first)
    second = table.open(table.free_row(), 3, 0, None)
    assert second.row == first.row and first.finished and not second.finished
    assert first.lengths()["cached_len"] == 5 and second.cached_len == 0
    with pytest.raises(InvalidArgumentError, match="not live"):
        table.rows_of([first])
    table.check_integrity()


class RowMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.rows = _Rows(5)
        self.live: set[int] = set()

    @rule()
    def allocate(self):
        if len(self.live) == 5:
            with pytest.raises(OutOfMemoryError):
                self.rows.allocate()
        else:
            row = self.rows.allocate()
            assert row not in self.live and 0 <= row < 5
            self.live.add(row)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        row = data.draw(st.sampled_from(sorted(self.live)))
        self.rows.free(row)
        self.live.remove(row)

    @rule(row=st.integers(-2, 6))
    def free_a_row_that_is_not_live(self, row):
        if row in self.live:
            return
        with pytest.raises(InvalidArgumentError):
            self.rows.free(row)

    @invariant()
    def matches_the_model(self):
        assert self.rows.live_rows == self.live and self.rows.table.num_live == len(self.live)
        self.rows.table.check_integrity()


TestRowMachine = RowMachine.TestCase
TestRowMachine.settings = settings(max_examples=30, stateful_step_count=30, deadline=None)


@settings(max_examples=60, deadline=None)
@given(page_size=st.sampled_from([1, 2, 5, 16, 24, 32, 48, 64]), max_seq_len=st.integers(1, 100), data=st.data())
def test_record_decode_pages_writes_each_page_clipped_to_its_row(page_size, max_seq_len, data):
    """Differential: ``record_decode_pages`` against a cell-by-cell loop, with pages at every
    page-aligned column, the last one of a row included (row widths that are and are not page
    multiples)."""
    table = make_table(rows=3, max_seq_len=max_seq_len)
    width = table.row_width
    starts = [(row, column) for row in range(3) for column in range(0, width, page_size)]
    chosen = data.draw(st.lists(st.sampled_from(starts), min_size=1, max_size=len(starts), unique=True))
    cells = np.array([row * width + column for row, column in chosen], dtype=np.int64)
    pages = np.arange(len(chosen), dtype=np.int32) * page_size + 1000
    expected = table.host_table.copy()
    for (row, column), page in zip(chosen, pages.tolist()):
        for offset in range(page_size):
            if column + offset < width:
                expected[row, column + offset] = page + offset
    table.record_decode_pages(cells, pages, page_size)
    np.testing.assert_array_equal(table.host_table, expected)


@pytest.mark.parametrize(("page_size", "max_seq_len"), [(16, 64), (64, 96)])
def test_record_decode_pages_of_more_pages_than_rows_then_fewer(page_size, max_seq_len):
    """Every page of every row in one call (more pages than request rows), then one page: a row
    width that is a page multiple (16 into 64) and one that is not (64 into 96, clipped)."""
    table = make_table(rows=2, max_seq_len=max_seq_len)
    width = table.row_width
    columns = range(0, width, page_size)
    cells = np.array([row * width + column for row in range(2) for column in columns], dtype=np.int64)
    pages = (np.arange(cells.size, dtype=np.int32) + 7) * page_size
    expected = table.host_table.copy()
    for cell, page in zip(cells.tolist(), pages.tolist()):
        row, column = divmod(cell, width)
        end = min(column + page_size, width)
        expected[row, column:end] = np.arange(page, page + end - column)
    table.record_decode_pages(cells, pages, page_size)
    np.testing.assert_array_equal(table.host_table, expected)
    expected[1, :page_size] = np.arange(page_size) + 3 * page_size
    table.record_decode_pages(cells[-len(columns):][:1], np.array([3 * page_size], dtype=np.int32), page_size)
    np.testing.assert_array_equal(table.host_table, expected)
