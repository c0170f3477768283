import unittest
from solution import *


class TestSolution(unittest.TestCase):
    def test_0(self):
        self.assertEqual(sum_digits(123), 6)

    def test_1(self):
        self.assertEqual(sum_digits(0), 0)

    def test_2(self):
        self.assertEqual(sum_digits(99), 18)

    def test_3(self):
        self.assertEqual(sum_digits(-45), 9)


if __name__ == '__main__':
    unittest.main()
