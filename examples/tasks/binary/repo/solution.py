def to_binary(n):
    return str(n)
