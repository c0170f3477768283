import unittest
from solution import *


class TestSolution(unittest.TestCase):
    def test_0(self):
        self.assertEqual(word_count('a b c'), 3)

    def test_1(self):
        self.assertEqual(word_count(''), 0)

    def test_2(self):
        self.assertEqual(word_count('one'), 1)

    def test_3(self):
        self.assertEqual(word_count('  two  words '), 2)


if __name__ == '__main__':
    unittest.main()
