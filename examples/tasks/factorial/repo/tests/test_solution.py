import unittest
from solution import *


class TestSolution(unittest.TestCase):
    def test_0(self):
        self.assertEqual(factorial(0), 1)

    def test_1(self):
        self.assertEqual(factorial(1), 1)

    def test_2(self):
        self.assertEqual(factorial(3), 6)

    def test_3(self):
        self.assertEqual(factorial(5), 120)


if __name__ == '__main__':
    unittest.main()
