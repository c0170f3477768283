import unittest
from solution import *


class TestSolution(unittest.TestCase):
    def test_0(self):
        self.assertEqual(is_palindrome('aba'), True)

    def test_1(self):
        self.assertEqual(is_palindrome('ab'), False)

    def test_2(self):
        self.assertEqual(is_palindrome('A man, a plan, a canal: Panama'), True)

    def test_3(self):
        self.assertEqual(is_palindrome(''), True)


if __name__ == '__main__':
    unittest.main()
