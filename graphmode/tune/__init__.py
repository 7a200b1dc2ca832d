"""`graphmode tune`: search a recipe's knobs against its contract, within a time budget.

    space    the axes (bucket sets, fusion, kernel selection, threads, precision) and applying them
    trial    one configuration compiled, checked against eager, timed and judged
    search   coordinate descent from the recipe as written, the budget, the Pareto set
    journal  finished trials, one JSON line each, so an interrupted run resumes
    version  the tuned recipe written beside the old one
"""
