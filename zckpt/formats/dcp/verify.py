from zckpt.io.integrity import Problem


def verify(path, ckpt, ctx) -> list[Problem]:
    return []
