import unittest
from solution import *


class TestSolution(unittest.TestCase):
    def test_0(self):
        self.assertEqual(to_fahrenheit(0), 32.0)

    def test_1(self):
        self.assertEqual(to_fahrenheit(100), 212.0)

    def test_2(self):
        self.assertEqual(to_fahrenheit(-40), -40.0)

    def test_3(self):
        self.assertEqual(to_fahrenheit(37), 98.6)


if __name__ == '__main__':
    unittest.main()
