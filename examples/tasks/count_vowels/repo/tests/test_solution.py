import unittest
from solution import *


class TestSolution(unittest.TestCase):
    def test_0(self):
        self.assertEqual(count_vowels('hello'), 2)

    def test_1(self):
        self.assertEqual(count_vowels(''), 0)

    def test_2(self):
        self.assertEqual(count_vowels('AEIOU'), 5)

    def test_3(self):
        self.assertEqual(count_vowels('xyz'), 0)


if __name__ == '__main__':
    unittest.main()
