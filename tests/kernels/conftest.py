"""Each test class lists its CASES (and NAN_CASES); this parametrizes `case` (and `nan_case`) with them."""


def pytest_generate_tests(metafunc):
    for name, attr in (("case", "CASES"), ("nan_case", "NAN_CASES")):
        if name in metafunc.fixturenames:
            cases = getattr(metafunc.cls, attr)
            metafunc.parametrize(name, cases, ids=["-".join(map(str, c)) for c in cases])
