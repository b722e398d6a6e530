# Solutions for labs/11-serving/scheduler-step.ipynb (format: tools/labs.py).
# CI runs the lab with each solution swapped in, and once per wrong block, expecting that task's
# check cell, and only that one, to fail, and its report to contain the block's hint.

# %% solution plan-step
def plan_step(running, waiting, free_pages, P, max_tokens):
    budget, free = max_tokens, free_pages
    held = {sid: pages for sid, _, _, pages in running}
    alive = [sid for sid, *_ in running]                       # oldest first
    known = {sid: k for sid, k, *_ in running}
    plan, preempted, queue = {}, [], list(waiting)
    for sid, k, computed, _ in running:                         # 1. running, oldest first
        n = min(k - computed, budget)
        if sid not in alive or n == 0:
            continue
        need = -(-(computed + n) // P) - held[sid]
        while need > free:
            victim = alive.pop()                                # the newest running sequence
            free, held[victim] = free + held[victim], 0
            budget += plan.pop(victim, 0)                       # its tokens leave the step
            preempted.append(victim)
            queue.insert(0, (victim, known[victim], 0))          # to the front, nothing computed
            if victim == sid:
                break
        if sid in alive:
            free, held[sid] = free - need, held[sid] + need
            plan[sid], budget = n, budget - n
    while queue and budget > 0:                                 # 2. waiting, in queue order
        sid, k, computed = queue[0]
        n = min(k - computed, budget)
        pages = -(-(computed + n) // P)
        if pages > free:
            break
        queue.pop(0)
        plan[sid], budget, free = n, budget - n, free - pages
    return list(plan.items()), sorted(preempted)

# %% wrong plan-step: preempts the oldest running sequence instead of the newest | hint: the victim is the newest running sequence
def plan_step(running, waiting, free_pages, P, max_tokens):
    budget, free = max_tokens, free_pages
    held = {sid: pages for sid, _, _, pages in running}
    alive = [sid for sid, *_ in running]                       # oldest first
    known = {sid: k for sid, k, *_ in running}
    plan, preempted, queue = {}, [], list(waiting)
    for sid, k, computed, _ in running:                         # 1. running, oldest first
        n = min(k - computed, budget)
        if sid not in alive or n == 0:
            continue
        need = -(-(computed + n) // P) - held[sid]
        while need > free:
            victim = alive.pop(0)
            free, held[victim] = free + held[victim], 0
            budget += plan.pop(victim, 0)                       # its tokens leave the step
            preempted.append(victim)
            queue.insert(0, (victim, known[victim], 0))          # to the front, nothing computed
            if victim == sid:
                break
        if sid in alive:
            free, held[sid] = free - need, held[sid] + need
            plan[sid], budget = n, budget - n
    while queue and budget > 0:                                 # 2. waiting, in queue order
        sid, k, computed = queue[0]
        n = min(k - computed, budget)
        pages = -(-(computed + n) // P)
        if pages > free:
            break
        queue.pop(0)
        plan[sid], budget, free = n, budget - n, free - pages
    return list(plan.items()), sorted(preempted)

# %% wrong plan-step: admits waiting prompts before the running decodes | hint: running sequences go first
def plan_step(running, waiting, free_pages, P, max_tokens):
    budget, free = max_tokens, free_pages
    held = {sid: pages for sid, _, _, pages in running}
    alive = [sid for sid, *_ in running]                       # oldest first
    known = {sid: k for sid, k, *_ in running}
    plan, preempted, queue = {}, [], list(waiting)
    while queue and budget > 0:
        wid, wk, wc = queue[0]
        wn = min(wk - wc, budget)
        if -(-(wc + wn) // P) > free:
            break
        queue.pop(0)
        plan[wid], budget, free = wn, budget - wn, free - -(-(wc + wn) // P)
    for sid, k, computed, _ in running:
        n = min(k - computed, budget)
        if sid not in alive or n == 0:
            continue
        need = -(-(computed + n) // P) - held[sid]
        while need > free:
            victim = alive.pop()                                # the newest running sequence
            free, held[victim] = free + held[victim], 0
            budget += plan.pop(victim, 0)                       # its tokens leave the step
            preempted.append(victim)
            queue.insert(0, (victim, known[victim], 0))          # to the front, nothing computed
            if victim == sid:
                break
        if sid in alive:
            free, held[sid] = free - need, held[sid] + need
            plan[sid], budget = n, budget - n
    while queue and budget > 0:                                 # 2. waiting, in queue order
        sid, k, computed = queue[0]
        n = min(k - computed, budget)
        pages = -(-(computed + n) // P)
        if pages > free:
            break
        queue.pop(0)
        plan[sid], budget, free = n, budget - n, free - pages
    return list(plan.items()), sorted(preempted)

# %% wrong plan-step: pages counted for the new tokens alone, ignoring the computed ones and the pages held | hint: ceil((computed + n) / P) pages in all
def plan_step(running, waiting, free_pages, P, max_tokens):
    budget, free = max_tokens, free_pages
    held = {sid: pages for sid, _, _, pages in running}
    alive = [sid for sid, *_ in running]                       # oldest first
    known = {sid: k for sid, k, *_ in running}
    plan, preempted, queue = {}, [], list(waiting)
    for sid, k, computed, _ in running:                         # 1. running, oldest first
        n = min(k - computed, budget)
        if sid not in alive or n == 0:
            continue
        need = -(-n // P)
        while need > free:
            victim = alive.pop()                                # the newest running sequence
            free, held[victim] = free + held[victim], 0
            budget += plan.pop(victim, 0)                       # its tokens leave the step
            preempted.append(victim)
            queue.insert(0, (victim, known[victim], 0))          # to the front, nothing computed
            if victim == sid:
                break
        if sid in alive:
            free, held[sid] = free - need, held[sid] + need
            plan[sid], budget = n, budget - n
    while queue and budget > 0:                                 # 2. waiting, in queue order
        sid, k, computed = queue[0]
        n = min(k - computed, budget)
        pages = -(-(computed + n) // P)
        if pages > free:
            break
        queue.pop(0)
        plan[sid], budget, free = n, budget - n, free - pages
    return list(plan.items()), sorted(preempted)

# %% wrong plan-step: asks the course's scheduler | hint: write it yourself
def plan_step(running, waiting, free_pages, P, max_tokens):
    from kernels.serving.scheduler import Scheduler
    sched = Scheduler(BlockAllocator(free_pages + sum(h for *_, h in running), P), max_tokens=max_tokens)
    return [(w.seq.id, len(w.tokens)) for w in sched.schedule()], []

# %% wrong plan-step: calls the lab's slip model with an option that models no slip | hint: write it yourself
def plan_step(running, waiting, free_pages, P, max_tokens):
    return slipped_plan(running, waiting, free_pages, P, max_tokens, pages="all")
