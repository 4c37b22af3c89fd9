"""Querysets whose SQL is compiled once, for the queries every request makes.

Building and compiling a queryset is most of what a small query costs Django: authenticating a
key (the key with its team, user and parent key, and whether the user is still a member) took
3.7 ms of the interpreter lock a request here, 0.1 ms of it in SQLite; under load every team's
requests wait for that lock (bench/isolation.py). `Precompiled` builds its queryset once per
process, with stand-in values, keeps the SQL and where the stand-ins went in its parameters, and
then runs that SQL on the calling thread's connection with each call's values, building the
objects as Django's own iterable does (`ModelIterable`: select_related objects and annotations
included, values through the compiler's converters). The database is still read on every call;
only the compiling is skipped. Once per process, not per thread: a flood of requests at once
grows the pool of request threads, and each new thread would compile again.

The values are adapted for the database as the queryset adapted the stand-ins: ints and strings
as they are, dates through the backend's own adapter. tests/accounts/test_precompiled_queries.py
checks the objects against the querysets' own, on SQLite and PostgreSQL.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.db import connections
from django.db.models import Model, QuerySet
from django.db.models.query import get_related_populators


@dataclass
class _Compiled:
    alias: str
    compiler: Any
    sql: str
    params: tuple
    positions: list[list[int]]  # for each stand-in, where it is in `params`
    init_list: list[str]
    start: int
    end: int
    populators: list
    annotations: dict[str, int]


class Precompiled:
    """`build(*values)` (a queryset of model instances) run with its SQL compiled once;
    `stand_ins` are values of the same kinds that no call passes (each must reach the
    SQL's parameters as itself, or as a date through the backend's adapter)."""

    def __init__(self, build: Callable[..., QuerySet], *stand_ins: Any) -> None:
        if len(set(map(repr, stand_ins))) != len(stand_ins):
            raise ValueError("the stand-ins must differ from one another")
        self._build = build
        self._stand_ins = stand_ins
        self._once: _Compiled | None = None
        self._lock = threading.Lock()

    def __call__(self, *values: Any) -> list[Model]:
        compiled = self._compiled()
        connection = connections[compiled.alias]  # this thread's
        params = list(compiled.params)
        for value, positions in zip(values, compiled.positions, strict=True):
            value = _adapt(connection, value)
            for position in positions:
                params[position] = value
        with connection.cursor() as cursor:
            cursor.execute(compiled.sql, params)
            rows = cursor.fetchall()
        objects = []
        for row in compiled.compiler.results_iter([rows]):
            obj = compiled.compiler.klass_info["model"].from_db(
                compiled.alias, compiled.init_list, row[compiled.start : compiled.end]
            )
            for populator in compiled.populators:
                populator.populate(row, obj)
            for name, position in compiled.annotations.items():
                setattr(obj, name, row[position])
            objects.append(obj)
        return objects

    def _compiled(self) -> _Compiled:
        # The compiler is kept for its converters and select list, which read the connection
        # it was made with only for its settings: the SQL runs on each caller's connection.
        compiled = self._once
        if compiled is None:
            with self._lock:
                if self._once is None:
                    self._once = self._compile(self._build(*self._stand_ins))
                compiled = self._once
        return compiled

    def _compile(self, queryset: QuerySet) -> _Compiled:
        alias = queryset.db
        compiler = queryset.query.get_compiler(using=alias)
        sql, params = compiler.as_sql()  # also fills compiler.select, klass_info, annotations
        connection = connections[alias]
        positions = []
        for stand_in in self._stand_ins:
            adapted = _adapt(connection, stand_in)
            found = [i for i, param in enumerate(params) if _same(param, adapted)]
            if not found:
                raise ValueError(f"{stand_in!r} is not among the query's parameters {params!r}")
            positions.append(found)
        select, klass_info = compiler.select, compiler.klass_info
        fields = klass_info["select_fields"]
        start, end = fields[0], fields[-1] + 1
        return _Compiled(
            alias=alias,
            compiler=compiler,
            sql=sql,
            params=tuple(params),
            positions=positions,
            init_list=[column[0].target.attname for column in select[start:end]],
            start=start,
            end=end,
            populators=get_related_populators(klass_info, select, alias),
            annotations=dict(compiler.annotation_col_map or {}),
        )


def _adapt(connection, value: Any) -> Any:
    if isinstance(value, datetime.date) and not isinstance(value, datetime.datetime):
        return connection.ops.adapt_datefield_value(value)
    return value


def _same(param: Any, adapted: Any) -> bool:
    return type(param) is type(adapted) and param == adapted
