def sum_digits(n):
    return n % 10
