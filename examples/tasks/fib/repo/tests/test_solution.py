import unittest
from solution import *


class TestSolution(unittest.TestCase):
    def test_0(self):
        self.assertEqual(fib(0), 0)

    def test_1(self):
        self.assertEqual(fib(1), 1)

    def test_2(self):
        self.assertEqual(fib(2), 1)

    def test_3(self):
        self.assertEqual(fib(10), 55)


if __name__ == '__main__':
    unittest.main()
