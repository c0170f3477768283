def flatten(xs):
    return xs
