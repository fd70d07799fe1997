"""ValueAssembler makes exactly the checks of verify_chunk, piece by piece, whatever the piece sizes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.support.cache_server_values import make_value
from cache_server.value_assembly import MAX_HEADER_BYTES, ValueAssembler
from storage_backends.chunk import ChunkFormatError, ChunkKeyError, verify_chunk

# Both sides of MAX_HEADER_BYTES: small values are checked at the end, large ones as they arrive.
SIZES = (40, 3000, 3 * MAX_HEADER_BYTES)


KEY = "ns/value"


def assemble(data: bytes, cuts: list[int], key: str = KEY) -> memoryview:
    """Feed ``data`` cut at the (sorted, deduplicated) offsets ``cuts``; return what finish() gives."""
    value = ValueAssembler(len(data), key)
    bounds = [0, *sorted({cut % len(data) for cut in cuts} - {0}), len(data)]
    for start, end in zip(bounds, bounds[1:], strict=False):
        value.add(memoryview(data)[start:end])
    return value.finish()


@settings(max_examples=30, deadline=None)
@given(size=st.sampled_from(SIZES), cuts=st.lists(st.integers(0, 1 << 20), max_size=6))
def test_an_intact_value_comes_back_unchanged_and_read_only(size: int, cuts: list[int]) -> None:
    data = make_value(size, num_bytes=size, key=KEY)
    value = assemble(data, cuts)
    assert bytes(value) == data
    assert value.readonly
    verify_chunk(value, key=KEY)


@settings(max_examples=40, deadline=None)
@given(
    size=st.sampled_from(SIZES),
    position=st.integers(0, 1 << 20),
    flip=st.integers(1, 255),
    cuts=st.lists(st.integers(0, 1 << 20), max_size=4),
)
def test_any_changed_byte_is_refused(size: int, position: int, flip: int, cuts: list[int]) -> None:
    damaged = bytearray(make_value(size, num_bytes=size, key=KEY))
    damaged[position % len(damaged)] ^= flip
    # verify_chunk is the reference: the assembler refuses exactly what it refuses.
    with pytest.raises(ChunkFormatError):
        verify_chunk(damaged, key=KEY)
    with pytest.raises(ChunkFormatError):
        assemble(bytes(damaged), cuts)


def test_a_size_that_disagrees_with_the_header_is_refused_at_the_first_large_piece() -> None:
    data = make_value(1, num_bytes=3 * MAX_HEADER_BYTES, key=KEY)
    value = ValueAssembler(len(data) + 10, KEY)
    with pytest.raises(ChunkFormatError, match="header says"):
        value.add(data[:MAX_HEADER_BYTES])


def test_more_bytes_than_announced_and_truncated_values_are_refused() -> None:
    data = make_value(2, num_bytes=1000, key=KEY)
    value = ValueAssembler(len(data), KEY)
    value.add(data)
    with pytest.raises(ChunkFormatError, match="more than the announced"):
        value.add(b"x")

    truncated = ValueAssembler(len(data), KEY)
    truncated.add(data[:-1])
    with pytest.raises(ChunkFormatError, match="truncated"):
        truncated.finish()


def test_bytes_that_are_not_a_chunk_are_refused_as_soon_as_the_header_has_arrived() -> None:
    garbage = b"not a chunk at all" * 10_000
    value = ValueAssembler(len(garbage), KEY)
    value.add(garbage[:1000])  # the header might still be incomplete: no verdict yet
    with pytest.raises(ChunkFormatError, match="not a kvstash chunk"):
        value.add(garbage[1000:MAX_HEADER_BYTES])


@settings(max_examples=20, deadline=None)
@given(size=st.sampled_from(SIZES), cuts=st.lists(st.integers(0, 1 << 20), max_size=4))
def test_a_value_serialized_for_another_key_is_refused(size: int, cuts: list[int]) -> None:
    data = make_value(size, num_bytes=size, key="ns/other")
    with pytest.raises(ChunkKeyError):
        verify_chunk(data, key=KEY)
    with pytest.raises(ChunkKeyError):
        assemble(data, cuts)
    assert bytes(assemble(data, cuts, key="ns/other")) == data


@settings(max_examples=30, deadline=None)
@given(
    size=st.sampled_from((*SIZES, 3 << 20)), steps=st.lists(st.integers(1, 1 << 21), min_size=1, max_size=6)
)
def test_fill_from_copies_as_the_writer_announces_and_keeps_its_own_copy(size: int, steps: list[int]) -> None:
    """A staged Put's copy (``fill_from``): each announced stretch is copied when it is
    announced, and what is returned is that copy, whatever the source turns into afterwards."""
    data = make_value(size, num_bytes=size, key=KEY)
    size = len(data)  # the header's bytes too
    source = bytearray(data)
    announced = [min(size, sum(steps[: i + 1])) for i in range(len(steps))] + [size]
    asked: list[int] = []

    def wait_for_more(num_copied: int) -> int:
        asked.append(num_copied)
        source[:num_copied] = bytes(num_copied)  # the writer scribbles over what was copied
        return next(count for count in announced if count > num_copied)

    value = ValueAssembler(size, KEY).fill_from(memoryview(source), wait_for_more)
    assert bytes(value) == data and value.readonly
    assert asked[0] == 0 and asked == sorted(set(asked))  # it waits only for bytes not yet copied


def test_fill_from_refuses_a_value_changed_before_it_was_copied() -> None:
    data = bytearray(make_value(5, num_bytes=3 * MAX_HEADER_BYTES, key=KEY))
    data[-1] ^= 1
    with pytest.raises(ChunkFormatError, match="checksum"):
        ValueAssembler(len(data), KEY).fill_from(memoryview(data))
    with pytest.raises(ChunkFormatError, match="expected"):
        ValueAssembler(len(data) + 1, KEY).fill_from(memoryview(data))


@pytest.mark.parametrize("area_bytes", [1 << 20, 4 << 20])
def test_a_value_larger_than_the_area_passes_through_it_as_a_ring(area_bytes: int) -> None:
    """Protocol 4's ring: the writer (``StagingArea.write`` with ``wait_for_room``) overwrites a
    part of the area only once the reader (``fill_from`` with ``copied``) has copied it out,
    and the reader's copy is the whole value."""
    import mmap
    import threading

    from storage_backends.staging_area import StagingArea

    data = make_value(7, num_bytes=9 << 20, key=KEY)
    area = StagingArea(mmap.mmap(-1, area_bytes), area_bytes)
    state = threading.Condition()
    announced, copied = [0], [0]

    def written(num_bytes: int) -> None:
        with state:
            announced[0] = num_bytes
            state.notify_all()

    def wait_for_room(num_bytes: int) -> None:
        with state:
            assert state.wait_for(lambda: copied[0] >= num_bytes, timeout=10)

    def wait_for_more(num_copied: int) -> int:
        with state:
            assert state.wait_for(lambda: announced[0] > num_copied, timeout=10)
            return announced[0]

    def copied_out(num_bytes: int) -> None:
        with state:
            copied[0] = num_bytes
            state.notify_all()

    writer = threading.Thread(target=area.write, args=([data], area_bytes // 4, written, wait_for_room))
    writer.start()
    with area.view() as source:
        value = ValueAssembler(len(data), KEY).fill_from(source, wait_for_more, copied_out)
    writer.join()
    assert bytes(value) == data
    with pytest.raises(ValueError, match="divide"):
        area.write([data], 3 << 18, written, wait_for_room)
    with pytest.raises(ValueError, match="does not fit"):
        area.write([data], area_bytes // 4, written)
    area.close()
