import unittest
from solution import *


class TestSolution(unittest.TestCase):
    def test_0(self):
        self.assertEqual(to_binary(5), '101')

    def test_1(self):
        self.assertEqual(to_binary(0), '0')

    def test_2(self):
        self.assertEqual(to_binary(8), '1000')

    def test_3(self):
        self.assertEqual(to_binary(1), '1')


if __name__ == '__main__':
    unittest.main()
