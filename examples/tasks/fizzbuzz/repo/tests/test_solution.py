import unittest
from solution import *


class TestSolution(unittest.TestCase):
    def test_0(self):
        self.assertEqual(fizzbuzz(3), 'Fizz')

    def test_1(self):
        self.assertEqual(fizzbuzz(5), 'Buzz')

    def test_2(self):
        self.assertEqual(fizzbuzz(15), 'FizzBuzz')

    def test_3(self):
        self.assertEqual(fizzbuzz(7), '7')


if __name__ == '__main__':
    unittest.main()
