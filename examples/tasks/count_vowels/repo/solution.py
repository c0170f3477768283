def count_vowels(s):
    return 0
