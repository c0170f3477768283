import unittest
from solution import *


class TestSolution(unittest.TestCase):
    def test_0(self):
        self.assertEqual(reverse('abc'), 'cba')

    def test_1(self):
        self.assertEqual(reverse(''), '')

    def test_2(self):
        self.assertEqual(reverse('ba'), 'ab')

    def test_3(self):
        self.assertEqual(reverse('xyz'), 'zyx')


if __name__ == '__main__':
    unittest.main()
