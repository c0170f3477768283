def factorial(n):
    return n
