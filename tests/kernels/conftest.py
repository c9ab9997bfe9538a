"""Each test class lists its CASES; this parametrizes its `case` argument with them."""


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        cases = metafunc.cls.CASES
        metafunc.parametrize("case", cases, ids=["-".join(map(str, c)) for c in cases])
