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


if __name__ == "__main__":
    unittest.main()
