KIND = "a value read as an attribute"


class Thing:
    """Made in the build function with ``sub.Thing()``: an attribute read for a call."""
