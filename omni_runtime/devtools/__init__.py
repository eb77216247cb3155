"""Development helpers: the local random model recipes, the scheduler test harness, the
offline drain helper and the scheduler demo. Tests, benchmarks and ``make demo`` use them;
production modules never import them (tests/test_layout.py checks)."""
