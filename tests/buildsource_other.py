"""A second notebook's worth of functions for tests/test_buildsource.py: a helper named like one in
buildsource_helpers, but another function."""


def shared_helper():
    return 1


def calls_other_helper():
    return shared_helper()
