import unittest
from solution import *


class TestSolution(unittest.TestCase):
    def test_0(self):
        self.assertEqual(add(1, 2), 3)

    def test_1(self):
        self.assertEqual(add(-1, 1), 0)

    def test_2(self):
        self.assertEqual(add(0, 0), 0)

    def test_3(self):
        self.assertEqual(add(-2, -3), -5)


if __name__ == '__main__':
    unittest.main()
