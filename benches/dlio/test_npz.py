"""The DLIO Python-client reader's NPZ decoding (npz.py) against np.load."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import npz  # noqa: E402


def saved(compressed: bool = False, **arrays: np.ndarray) -> bytes:
    buf = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buf, **arrays)
    return buf.getvalue()


@pytest.mark.parametrize(
    "x",
    [
        np.arange(4 * 5 * 3, dtype=np.uint8).reshape(4, 5, 3),
        np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4)),
        np.zeros((0, 7), dtype=np.int64),
        np.array(3.5),
    ],
)
def test_a_stored_array_is_a_view_of_the_bytes_and_equals_np_load(x: np.ndarray) -> None:
    data = saved(x=x, y=np.ones(3))
    got = npz.array(data, "x")
    want = np.load(io.BytesIO(data))["x"]
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.array_equal(got, want)
    if got.size:
        assert np.shares_memory(got, np.frombuffer(data, dtype=np.uint8)), "a copy was made"
        assert not got.flags.writeable


def test_a_compressed_member_is_decoded() -> None:
    x = np.arange(1000, dtype=np.int16)
    assert np.array_equal(npz.array(saved(True, x=x)), x)


def test_a_missing_array_or_a_non_zip_is_an_error() -> None:
    with pytest.raises(KeyError, match="z is not an array"):
        npz.array(saved(x=np.ones(2)), "z")
    with pytest.raises(Exception, match="zip"):
        npz.array(b"not a zip file at all")
