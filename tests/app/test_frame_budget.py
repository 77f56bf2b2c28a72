from app.frame_budget import FrameBudget


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_redraw_is_followed_by_a_pause_proportional_to_its_cost():
    wall, cpu = FakeClock(), FakeClock()
    budget = FrameBudget(0.02, clock=wall, cpu_clock=cpu)
    assert budget.due()
    budget.begin()
    cpu.now += 0.005  # the redraw and its painting took 5 ms of GUI CPU
    budget.end()
    assert budget.last_cost == 0.005
    wall.now += 0.20
    assert not budget.due()  # 5 ms at 2% means one redraw per 250 ms
    wall.now += 0.06
    assert budget.due()


def test_no_new_redraw_while_one_is_being_painted():
    wall, cpu = FakeClock(), FakeClock()
    budget = FrameBudget(1.0, clock=wall, cpu_clock=cpu)
    budget.begin()
    wall.now += 1
    assert not budget.due()
    budget.end()
    assert budget.due()


def test_cheap_redraws_keep_the_timer_rate():
    wall, cpu = FakeClock(), FakeClock()
    budget = FrameBudget(0.02, clock=wall, cpu_clock=cpu)
    drawn = 0
    for _ in range(20):  # one second of 50 ms ticks
        if budget.due():
            budget.begin()
            cpu.now += 0.0005
            budget.end()
            drawn += 1
        wall.now += 0.05
    assert drawn == 20
    assert budget.skipped == 0


def test_steps_of_a_deleted_owner_never_run(qtbot):
    from PySide6.QtCore import QObject

    from app.frame_budget import in_turns

    owner, alive, ran, done = QObject(), QObject(), [], []
    in_turns([lambda: ran.append(1), lambda: ran.append(2)], owner=owner)
    owner.deleteLater()  # the window closed before its charts were drawn
    # a second chain, started after: once it is done, the first one's turns have come and gone
    in_turns([lambda: None, lambda: None, lambda: None], lambda: done.append(True), owner=alive)
    qtbot.waitUntil(lambda: bool(done))
    assert ran == []
