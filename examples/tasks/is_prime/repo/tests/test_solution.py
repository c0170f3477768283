import unittest
from solution import *


class TestSolution(unittest.TestCase):
    def test_0(self):
        self.assertEqual(is_prime(2), True)

    def test_1(self):
        self.assertEqual(is_prime(9), False)

    def test_2(self):
        self.assertEqual(is_prime(1), False)

    def test_3(self):
        self.assertEqual(is_prime(97), True)

    def test_4(self):
        self.assertEqual(is_prime(25), False)


if __name__ == '__main__':
    unittest.main()
