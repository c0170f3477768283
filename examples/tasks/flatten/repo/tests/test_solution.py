import unittest
from solution import *


class TestSolution(unittest.TestCase):
    def test_0(self):
        self.assertEqual(flatten([1, [2, 3]]), [1, 2, 3])

    def test_1(self):
        self.assertEqual(flatten([]), [])

    def test_2(self):
        self.assertEqual(flatten([[1, [2]], 3]), [1, 2, 3])

    def test_3(self):
        self.assertEqual(flatten([1]), [1])


if __name__ == '__main__':
    unittest.main()
