import unittest
from solution import *


class TestSolution(unittest.TestCase):
    def test_0(self):
        self.assertEqual(gcd(12, 8), 4)

    def test_1(self):
        self.assertEqual(gcd(7, 3), 1)

    def test_2(self):
        self.assertEqual(gcd(10, 5), 5)

    def test_3(self):
        self.assertEqual(gcd(9, 6), 3)


if __name__ == '__main__':
    unittest.main()
