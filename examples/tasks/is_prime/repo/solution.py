def is_prime(n):
    return n % 2 == 1
