"""Unit tests of vgpu.torch without torch or a GPU: python3 -m unittest discover deploy/python/tests"""

import ctypes
import os
import sys
import threading
import unittest
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import vgpu.torch as helper  # noqa: E402


class FakeAbi:
    """The interposer's three functions: asks for `asked` bytes until the hook says done."""

    def __init__(self, asked):
        self.asked = asked
        self.done_with = threading.Event()
        self.freed = None

    def register(self):
        return 0

    def want(self, pointer):
        pointer._obj.value = 0 if self.done_with.is_set() else self.asked
        return 0

    def done(self, freed):
        self.freed = freed
        self.done_with.set()
        return 0


class ColdAbi:
    """The interposer's vgpu_memory_cold: marks what it is told, `marks` the calls."""

    def __init__(self, rc=0, marked=0):
        self.rc, self.marked, self.marks = rc, marked, []

    def cold(self, address, nbytes, cold, out):
        self.marks.append((address, nbytes, cold))
        out._obj.value = self.marked
        return self.rc


class Storage:
    def data_ptr(self):
        return 0x7000

    def nbytes(self):
        return 4096


class Tensor:
    def untyped_storage(self):
        return Storage()


class HelperTest(unittest.TestCase):
    def setUp(self):
        helper._thread = None

    def test_without_the_interposer_it_warns_and_runs_nothing(self):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.assertFalse(helper.enable())
        self.assertIn("libvgpu_cuda.so is not loaded", str(caught[0].message))
        self.assertIsNone(helper._thread)

    def test_a_want_runs_the_hook_once_and_reports_what_it_freed(self):
        abi = FakeAbi(8 << 20)
        calls = []
        original = helper._Abi.load
        helper._Abi.load = classmethod(lambda cls: abi)
        try:
            self.assertTrue(helper.enable(on_want=lambda: calls.append(1) or 6 << 20,
                                          poll_interval_s=0.001))
            self.assertTrue(helper.enable(), "a second enable changes nothing")
            self.assertTrue(abi.done_with.wait(10), "the helper never answered")
        finally:
            helper._Abi.load = original
        self.assertEqual(abi.freed, 6 << 20)
        self.assertEqual(calls, [1])

    def with_abi(self, abi, call):
        original = helper._Abi.load
        helper._Abi.load = classmethod(lambda cls: abi)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                return call(), caught
        finally:
            helper._Abi.load = original

    def test_mark_cold_marks_a_tensors_storage_or_an_address(self):
        abi = ColdAbi(marked=4096)
        got, caught = self.with_abi(abi, lambda: helper.mark_cold(Tensor()))
        self.assertEqual((got, caught), (4096, []))
        got, _ = self.with_abi(abi, lambda: helper.mark_cold(0x9000, 512, cold=False))
        self.assertEqual(abi.marks, [(0x7000, 4096, 1), (0x9000, 512, 0)])

    def test_mark_cold_warns_when_nothing_can_be_marked(self):
        got, caught = self.with_abi(ColdAbi(rc=1), lambda: helper.mark_cold(0x9000, 512))
        self.assertEqual(got, 0)
        self.assertIn("never asked back", str(caught[0].message))
        got, caught = self.with_abi(None, lambda: helper.mark_cold(0x9000, 512))
        self.assertEqual(got, 0)
        self.assertIn("not loaded", str(caught[0].message))
        with self.assertRaises(RuntimeError):
            self.with_abi(ColdAbi(rc=-2), lambda: helper.mark_cold(0x9000, 512))
        with self.assertRaises(ValueError):
            helper.mark_cold(-1, 512)


if __name__ == "__main__":
    unittest.main()
