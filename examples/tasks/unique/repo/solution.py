def unique(xs):
    return xs
