import unittest
from solution import *


class TestSolution(unittest.TestCase):
    def test_0(self):
        self.assertEqual(max_list([1, 3, 2]), 3)

    def test_1(self):
        self.assertEqual(max_list([5]), 5)

    def test_2(self):
        self.assertEqual(max_list([-1, -5]), -1)

    def test_3(self):
        self.assertEqual(max_list([1, 2, 9]), 9)


if __name__ == '__main__':
    unittest.main()
