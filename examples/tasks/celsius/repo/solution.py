def to_fahrenheit(c):
    return c * 2 + 30
