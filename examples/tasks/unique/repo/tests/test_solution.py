import unittest
from solution import *


class TestSolution(unittest.TestCase):
    def test_0(self):
        self.assertEqual(unique([1, 1, 2]), [1, 2])

    def test_1(self):
        self.assertEqual(unique([3, 1, 3]), [3, 1])

    def test_2(self):
        self.assertEqual(unique([]), [])

    def test_3(self):
        self.assertEqual(unique([2, 2]), [2])


if __name__ == '__main__':
    unittest.main()
